"""The content address: exact formula, chaining, tenants, namespaces, determinism, speed."""
import hashlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from duplex.kvstore import keys
from duplex.kvstore.keys import block_keys, key_from_hex, key_hex, namespace, tenant_salt

NS = namespace("m", "float16", 4)
TOKENS = list(range(100, 150))  # 12 full blocks of 4, plus 2 tokens

_SCRIPT = """
from duplex.kvstore.keys import block_keys, namespace, tenant_salt
ns = namespace("m", "float16", 4, "L", tenant_salt("sk-a", "s1"))
print(ns.hex(), *[k.hex() for k in block_keys(ns, list(range(100, 150)), 4)])
"""


def test_key_is_blake2b16_of_parent_and_le_uint32_tokens():
    expected, prev = [], NS
    for i in range(12):
        block = np.array(TOKENS[4 * i:4 * i + 4], dtype="<u4").tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        expected.append(prev)
    assert block_keys(NS, TOKENS, 4) == expected


def test_namespace_is_pinned():
    # Changing this value means every stored key changes: bump LAYOUT_VERSION instead.
    assert namespace("m", "float16", 4).hex() == NS.hex() == _pinned_namespace()


def _pinned_namespace() -> str:
    h = hashlib.blake2b(b"duplex-kv-namespace", digest_size=16)
    for field in (keys.LAYOUT_VERSION.to_bytes(8, "little"), b"m", b"float16",
                  (4).to_bytes(8, "little"), b"", b""):
        h.update(len(field).to_bytes(8, "little") + field)
    return h.hexdigest()


def test_same_keys_in_another_process():
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, check=True, cwd=os.getcwd()).stdout.split()
    ns = namespace("m", "float16", 4, "L", tenant_salt("sk-a", "s1"))
    assert out == [ns.hex()] + [k.hex() for k in block_keys(ns, TOKENS, 4)]


@pytest.mark.parametrize("block", [0, 5, 11])
def test_changing_one_token_changes_that_key_and_all_later_keys_only(block):
    changed = list(TOKENS)
    changed[4 * block + 2] += 1
    before, after = block_keys(NS, TOKENS, 4), block_keys(NS, changed, 4)
    assert after[:block] == before[:block]
    assert all(a != b for a, b in zip(after[block:], before[block:]))


def test_partial_blocks_get_no_key():
    assert block_keys(NS, [1, 2, 3], 4) == []
    assert block_keys(NS, [], 4) == []
    assert block_keys(NS, TOKENS[:7], 4) == block_keys(NS, TOKENS[:4], 4)
    assert len(block_keys(NS, TOKENS, 4)) == 12


def test_incremental_extension_equals_hashing_at_once():
    full = block_keys(NS, TOKENS, 4)
    head = block_keys(NS, TOKENS[:20], 4)
    tail = block_keys(NS, TOKENS, 4, parent=head[-1], start_block=len(head))
    assert head + tail == full
    assert block_keys(NS, TOKENS[:22], 4, parent=full[4], start_block=5) == []


def test_parent_must_match_start_block():
    with pytest.raises(ValueError):
        block_keys(NS, TOKENS, 4, start_block=2)
    with pytest.raises(ValueError):
        block_keys(NS, TOKENS, 4, parent=NS)
    with pytest.raises(ValueError):
        block_keys(NS, TOKENS, 0)


def test_token_ids_outside_uint32_are_rejected():
    with pytest.raises(ValueError):
        block_keys(NS, [0, 1, 2, -1], 4)
    with pytest.raises(ValueError):
        block_keys(NS, [0, 1, 2, 2**32], 4)
    with pytest.raises(TypeError):
        block_keys(NS, [0.0, 1.0, 2.0, 3.0], 4)
    assert block_keys(NS, [0, 1, 2, 2**32 - 1], 4) != []


def test_numpy_and_list_inputs_agree():
    as_list = block_keys(NS, TOKENS, 4)
    assert block_keys(NS, np.array(TOKENS, dtype=np.int64), 4) == as_list
    assert block_keys(NS, np.array(TOKENS, dtype=np.uint32), 4) == as_list
    assert block_keys(NS, tuple(TOKENS), 4) == as_list


def test_namespace_changes_with_every_component(monkeypatch):
    base = namespace("m", "float16", 4, "L", b"")
    variants = [namespace("m2", "float16", 4, "L"), namespace("m", "bfloat16", 4, "L"),
                namespace("m", "float16", 8, "L"), namespace("m", "float16", 4, "L2"),
                namespace("m", "float16", 4, "L", b"salt")]
    monkeypatch.setattr(keys, "LAYOUT_VERSION", keys.LAYOUT_VERSION + 1)
    variants.append(namespace("m", "float16", 4, "L"))
    assert len({base, *variants}) == 1 + len(variants)


def test_namespace_fields_cannot_run_together():
    assert namespace("ab", "c", 4) != namespace("a", "bc", 4)


def test_tenant_salt_public_and_keyed():
    assert tenant_salt(None) == b"" == tenant_salt("")
    assert tenant_salt("sk-a") == tenant_salt("sk-a")
    assert len(tenant_salt("sk-a")) == 16
    assert tenant_salt("sk-a") != tenant_salt("sk-b")


def test_cache_salt_only_narrows_a_tenant():
    salts = {tenant_salt(k, c) for k in (None, "sk-a", "sk-b") for c in (None, "x", "y")}
    assert len(salts) == 9  # every (tenant, cache_salt) pair is its own namespace
    # No cache_salt moves a tenant onto another tenant's salt (or the public one).
    assert tenant_salt("sk-a", "x") not in {tenant_salt("sk-b"), tenant_salt(None), b""}


def test_tenants_have_disjoint_keys():
    def all_keys(api_key, cache_salt=None):
        ns = namespace("m", "float16", 4, "", tenant_salt(api_key, cache_salt))
        return set(block_keys(ns, TOKENS, 4))
    a, b, public = all_keys("sk-a"), all_keys("sk-b"), all_keys(None)
    narrowed = all_keys("sk-a", "x")
    assert len(a) == len(b) == len(public) == len(narrowed) == 12
    assert not (a & b) and not (a & public) and not (b & public) and not (narrowed & a)


def test_key_hex_round_trip():
    key = block_keys(NS, TOKENS, 4)[0]
    assert key_hex(key) == key.hex() and len(key_hex(key)) == 32
    assert key_from_hex(key_hex(key)) == key
    with pytest.raises(ValueError):
        key_from_hex("abcd")


def test_8k_token_prompt_hashes_fast():
    tokens = list(range(8192))
    best = min(_time(lambda: block_keys(NS, tokens, 16)) for _ in range(5))
    assert len(block_keys(NS, tokens, 16)) == 512
    assert best / 512 < 50e-6, f"{best / 512 * 1e6:.1f} µs per block"  # measured ~1 µs


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
