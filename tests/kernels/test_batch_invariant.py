"""Batch-invariant mode on CPU: each invariant asserted bitwise, each bi_* op close to its
reference, and the plain ops' lack of invariance reported (skipped, not failed, where this
machine happens to make them invariant)."""
import pytest
import torch

from kernel_factories import attention_args, pack_paged_batch
from duplex.kernels import batch_invariant as bi
from duplex.kernels import ops
from duplex.kernels.attention import paged_attention_ref
from duplex.kernels.rms_norm import rms_norm_ref

ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 31, 32, 33, 40, 64, 65, 100]


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _assert_rows_invariant(fn, a):
    """fn's rows do not depend on how many rows come with them, nor on their order."""
    full = fn(a)
    for m in (m for m in ROW_COUNTS if m <= a.shape[0]):
        assert torch.equal(fn(a[:m]), full[:m]), f"rows differ at M={m}"
    perm = torch.randperm(a.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(fn(a[perm]), full[perm]), "rows differ when reordered"


def _first_variant_m(fn, a):
    """The first row count whose rows differ from the full batch's, or None."""
    full = fn(a)
    return next((m for m in ROW_COUNTS if not torch.equal(fn(a[:m]), full[:m])), None)


# ---------------------------------------------------------------- the switch

def test_switch_is_process_wide_and_restores():
    assert not bi.is_batch_invariant()
    with bi.set_batch_invariant_mode():
        assert bi.is_batch_invariant()
        with bi.set_batch_invariant_mode(False):
            assert not bi.is_batch_invariant()
        assert bi.is_batch_invariant()
    assert not bi.is_batch_invariant()


def test_ops_dispatch_to_bi_versions_when_on():
    x, weight = _randn(5, 64), _randn(48, 64, seed=1)
    with bi.set_batch_invariant_mode():
        assert torch.equal(ops.linear(x, weight), bi.bi_linear(x, weight))
        assert torch.equal(ops.log_softmax(x), bi.bi_log_softmax(x))
        assert torch.equal(ops.rms_norm(x, weight[0], 1e-6), bi.bi_rms_norm(x, weight[0], 1e-6))
        assert torch.equal(ops.silu(x), bi.bi_silu(x))
    assert torch.equal(ops.linear(x, weight), torch.nn.functional.linear(x, weight))


# ---------------------------------------------------------------- matmul

@pytest.mark.parametrize("n, k", [(1536, 576), (576, 1536), (100, 37)])
def test_bi_linear_rows_invariant(n, k):
    a, weight, bias = _randn(100, k), _randn(n, k, seed=1), _randn(n, seed=2)
    _assert_rows_invariant(lambda x: bi.bi_linear(x, weight, bias), a)
    torch.testing.assert_close(bi.bi_linear(a, weight, bias),
                               torch.nn.functional.linear(a, weight, bias), atol=1e-4, rtol=1e-5)


def test_bi_linear_keeps_leading_dims_and_bulk_tile():
    a, weight = _randn(2, 3, 64), _randn(16, 64, seed=1)
    assert bi.bi_linear(a, weight).shape == (2, 3, 16)
    assert bi._tiles_for(weight.t())[0] == bi.TILE_ROWS[0]


def test_plain_linear_is_not_batch_invariant_here():
    a, weight = _randn(130, 576), _randn(1536, 576, seed=1)
    m = _first_variant_m(lambda x: torch.nn.functional.linear(x, weight), a)
    if m is None:
        pytest.skip("plain F.linear happens to be batch invariant on this machine")
    assert m in ROW_COUNTS  # e.g. M=1 takes MKL's GEMV path


# ---------------------------------------------------------------- rows: norm, softmax, silu

def test_bi_rms_norm_rows_invariant_and_close():
    a, residual, weight = _randn(130, 576), _randn(130, 576, seed=1), _randn(576, seed=2)
    _assert_rows_invariant(lambda x: bi.bi_rms_norm(x, weight, 1e-5), a)
    _assert_rows_invariant(lambda x: bi.bi_rms_norm(x, weight, 1e-5, offset=1.0), a)
    out, new_residual = bi.bi_rms_norm(a, weight, 1e-5, residual)
    expected, expected_residual = rms_norm_ref(a, weight, 1e-5, residual)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bi_softmax_rows_invariant_and_close():
    logits = 4 * _randn(40, 49152)
    _assert_rows_invariant(bi.bi_log_softmax, logits)
    _assert_rows_invariant(bi.bi_softmax, logits)
    torch.testing.assert_close(bi.bi_log_softmax(logits), torch.log_softmax(logits, -1),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bi.bi_softmax(logits[:, :100], dim=0),
                               torch.softmax(logits[:, :100], dim=0), atol=1e-6, rtol=1e-5)


def test_bi_silu_rows_invariant_and_close():
    a = 3 * _randn(130, 1537)  # odd width: rows straddle vector and scalar-tail elements
    _assert_rows_invariant(bi.bi_silu, a)
    torch.testing.assert_close(bi.bi_silu(a), torch.nn.functional.silu(a))


def test_tree_sum_is_exact_on_integers():
    x = torch.randint(-1000, 1000, (5, 1001)).float()
    assert torch.equal(bi.tree_sum(x), x.sum(-1))


@pytest.mark.parametrize("name, fn, width", [
    ("sum", lambda x: x.sum(-1), 49152),
    ("silu", torch.nn.functional.silu, 1537),
])
def test_plain_reductions_and_silu_are_not_batch_invariant_here(name, fn, width):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a test process pinned to one core runs 1 (tests/conftest.py)
    try:
        m = _first_variant_m(fn, 3 * _randn(130, width))
    finally:
        torch.set_num_threads(threads)
    if m is None:
        pytest.skip(f"plain {name} happens to be batch invariant on this machine")


# ---------------------------------------------------------------- attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
TARGET_LEN, TARGET_QUERIES = 300, 10  # crosses KV_CHUNK boundaries


def _sequence(seq_len, seed):
    k, v = (_randn(seq_len, NUM_KV_HEADS, HEAD_DIM, seed=seed + i) for i in range(2))
    q = _randn(seq_len, NUM_HEADS, HEAD_DIM, seed=seed + 2)  # a query for every position
    return k, v, q


def _part(seq, upto, q_len):
    """The sequence cut to its first `upto` positions, asking for its last q_len queries."""
    k, v, q = seq
    return k[:upto], v[:upto], q[upto - q_len:upto]


def _run(parts, fn, block_size=16, **kwargs):
    batch = pack_paged_batch(parts, block_size=block_size)
    return fn(*attention_args(batch), 0.25, **kwargs), batch["query_start_loc"].tolist()


@pytest.mark.parametrize("kwargs", [{}, {"sliding_window": 140}, {"soft_cap": 3.0}])
def test_bi_attention_token_identical_in_prefill_decode_and_any_batch(kwargs):
    target = _sequence(TARGET_LEN, seed=0)
    others = [_sequence(n, seed=10 * n) for n in (37, 700, 130)]
    run = lambda parts, **kw: _run(parts, bi.bi_paged_attention, **kwargs, **kw)  # noqa: E731
    prefill, _ = run([_part(target, TARGET_LEN, TARGET_QUERIES)])
    mixed, starts = run([_part(others[0], 37, 1), _part(target, TARGET_LEN, TARGET_QUERIES),
                         _part(others[1], 700, 20), _part(others[2], 130, 1)])
    assert torch.equal(mixed[starts[1]:starts[2]], prefill)
    for j in range(TARGET_QUERIES):
        pos = TARGET_LEN - TARGET_QUERIES + j
        alone, _ = run([_part(target, pos + 1, 1)], block_size=4)
        batched, _ = run([_part(others[1], 700, 1), _part(target, pos + 1, 1),
                          _part(others[0], 37, 1)])
        rechunked, _ = run([_part(target, pos + 1, 3)])  # a smaller prefill chunk ending here
        assert torch.equal(alone[0], prefill[j]), f"decode != prefill at position {pos}"
        assert torch.equal(batched[1], prefill[j]), f"batched decode differs at {pos}"
        assert torch.equal(rechunked[-1], prefill[j]), f"other chunking differs at {pos}"
    expected, _ = run([_part(target, TARGET_LEN, TARGET_QUERIES)])
    reference, _ = _run([_part(target, TARGET_LEN, TARGET_QUERIES)], paged_attention_ref,
                        **kwargs)
    torch.testing.assert_close(expected, reference, atol=1e-5, rtol=1e-5)


def test_bi_attention_without_bmm_falls_back_to_per_item_mm(monkeypatch):
    monkeypatch.setattr(bi, "_bmm_is_itemwise", {})
    monkeypatch.setattr(bi, "_probe_bmm", lambda *args: False)
    target = _sequence(140, seed=5)
    prefill, _ = _run([_part(target, 140, 4)], bi.bi_paged_attention)
    batched, _ = _run([_part(_sequence(60, seed=6), 60, 1), _part(target, 139, 1)],
                      bi.bi_paged_attention)
    assert torch.equal(batched[1], prefill[2])
    reference, _ = _run([_part(target, 140, 4)], paged_attention_ref)
    torch.testing.assert_close(prefill, reference, atol=1e-5, rtol=1e-5)


def test_bi_attention_bf16_cache():
    parts = [tuple(t.bfloat16() for t in _part(_sequence(150, seed=3), 150, n)) for n in (1, 5)]
    out, _ = _run(parts, bi.bi_paged_attention)
    reference, _ = _run(parts, paged_attention_ref)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference, atol=1e-2, rtol=1e-2)


def test_plain_attention_decode_vs_prefill_is_reported():
    target = _sequence(TARGET_LEN, seed=0)
    prefill, _ = _run([_part(target, TARGET_LEN, TARGET_QUERIES)], paged_attention_ref)
    differs = any(
        not torch.equal(_run([_part(target, pos + 1, 1)], paged_attention_ref)[0][0],
                        prefill[pos - TARGET_LEN + TARGET_QUERIES])
        for pos in range(TARGET_LEN - TARGET_QUERIES, TARGET_LEN))
    if not differs:
        pytest.skip("the plain reference happens to give decode == prefill bitwise here")
