"""The content address of a KV block: one versioned function for every cache in Duplex.

Owns the key scheme used by the device prefix cache, the router, KV transfer and the disk
store alike. A key names the KV of one FULL block of tokens *together with everything before
it*, so equal keys mean equal KV:

    ns        = blake2b-16(canonical(LAYOUT_VERSION, model_id, kv_dtype, block_size,
                                     layout, tenant_salt))
    key[0]    = blake2b-16(ns       ‖ le_u32(tokens of block 0))
    key[i]    = blake2b-16(key[i-1] ‖ le_u32(tokens of block i))

Token ids are encoded as little-endian uint32 (every vocabulary in use fits). Partial blocks
get no key. Bump LAYOUT_VERSION whenever the KV byte layout or this scheme changes: every old
key then becomes unreachable instead of wrong. A new KV encoding beside the old ones (the int8
pool's packed rows) is a new kv_dtype value, so its own namespace, and needs no bump.

Tenants are isolated by the namespace: the tenant salt is derived server-side from the API key,
and a per-request cache_salt can only narrow a tenant's namespace, never reach another's.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

LAYOUT_VERSION = 1
KEY_BYTES = 16
TOKEN_DTYPE = np.dtype("<u4")  # on-hash encoding of one token id

_NAMESPACE_MAGIC = b"duplex-kv-namespace"
_TENANT_PERSON = b"duplex-tenant"  # blake2b personalisation: tenant salts
_NARROW_PERSON = b"duplex-narrow"  # ... and cache_salt-narrowed salts, kept apart


def _field(data: bytes) -> bytes:
    """Length-prefixed field, so no two field tuples share an encoding."""
    return struct.pack("<Q", len(data)) + data


def namespace(model_id: str, kv_dtype: str, block_size: int, layout: str = "",
              tenant_salt: bytes = b"") -> bytes:
    """16-byte namespace of one (model, KV dtype, block size, layout, tenant) combination."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    h = hashlib.blake2b(_NAMESPACE_MAGIC, digest_size=KEY_BYTES)
    for data in (struct.pack("<Q", LAYOUT_VERSION), model_id.encode(), kv_dtype.encode(),
                 struct.pack("<Q", block_size), layout.encode(), bytes(tenant_salt)):
        h.update(_field(data))
    return h.digest()


def _token_bytes(token_ids: Sequence[int]) -> memoryview:
    """Token ids as little-endian uint32 bytes; ValueError on ids outside [0, 2**32)."""
    ids = np.asarray(token_ids)
    if ids.size == 0:
        return memoryview(b"")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {ids.dtype}")
    if ids.dtype != TOKEN_DTYPE and (int(ids.min()) < 0 or int(ids.max()) >= 2**32):
        raise ValueError("token ids must lie in [0, 2**32)")
    return memoryview(ids.astype(TOKEN_DTYPE, copy=False).tobytes())


def block_keys(ns: bytes, token_ids: Sequence[int], block_size: int,
               parent: bytes | None = None, start_block: int = 0) -> list[bytes]:
    """Keys of the full blocks of `token_ids` from block `start_block` on.

    `token_ids` is the whole sequence; blocks before `start_block` are not hashed again.
    `parent` is the key of block `start_block - 1` (required when start_block > 0, must be
    None when it is 0: the first block chains to `ns`). To extend incrementally:
    ``keys += block_keys(ns, token_ids, bs, parent=keys[-1], start_block=len(keys))``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if (start_block > 0) != (parent is not None) or start_block < 0:
        raise ValueError("parent must be given exactly when start_block > 0")
    num_blocks = len(token_ids) // block_size
    if num_blocks <= start_block:
        return []
    data = _token_bytes(token_ids[start_block * block_size:num_blocks * block_size])
    stride = block_size * TOKEN_DTYPE.itemsize
    prev = ns if parent is None else parent
    keys = []
    for offset in range(0, len(data), stride):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(data[offset:offset + stride])
        prev = h.digest()
        keys.append(prev)
    return keys


def tenant_salt(api_key: str | None, cache_salt: str | None = None) -> bytes:
    """Server-side tenant salt for `namespace`.

    No API key (or an empty one) is the public tenant, salt b"". A key gives
    blake2b(api_key). A per-request `cache_salt` narrows the tenant's salt to
    blake2b(tenant salt ‖ cache_salt) under a different personalisation, so no cache_salt
    can produce another tenant's salt (that would need a blake2b collision).
    """
    salt = b""
    if api_key:
        salt = hashlib.blake2b(api_key.encode(), digest_size=KEY_BYTES,
                               person=_TENANT_PERSON).digest()
    if cache_salt:
        h = hashlib.blake2b(_field(salt), digest_size=KEY_BYTES, person=_NARROW_PERSON)
        h.update(cache_salt.encode())
        salt = h.digest()
    return salt


def salt_from_wire(cache_salt: str) -> bytes:
    """The salt an AddRequest's `cache_salt` stands for: its hex (what the frontend sends,
    from `tenant_salt`), else its text. Workers and the router derive namespaces with it."""
    try:
        return bytes.fromhex(cache_salt)
    except ValueError:
        return cache_salt.encode()


def key_hex(key: bytes) -> str:
    """Lower-case hex of a key (file names, logs, wire)."""
    return bytes(key).hex()


def key_from_hex(text: str) -> bytes:
    """Inverse of `key_hex`; ValueError unless it is exactly KEY_BYTES of hex."""
    key = bytes.fromhex(text)
    if len(key) != KEY_BYTES:
        raise ValueError(f"not a {KEY_BYTES}-byte key: {text!r}")
    return key
