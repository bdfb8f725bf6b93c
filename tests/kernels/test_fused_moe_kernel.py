"""Fused MoE: the expert alignment exactly, the triton grouped GEMMs against the reference."""
import pytest
import torch

from duplex.kernels.fused_moe import align_by_expert, fused_moe_ref


def _moe_case(num_tokens=20, num_experts=8, top_k=2, hidden=32, inter=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    # experts 0..num_experts-2 only: the last one gets no token
    ids = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k]
                       for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    return x, ids, weights, w13, w2


def test_align_puts_every_pair_once_in_a_block_of_its_expert():
    _, ids, _, _, _ = _moe_case()
    sorted_pairs, block_experts = align_by_expert(ids, 8, 16)
    flat = ids.reshape(-1)
    assert sorted_pairs.shape == (16 * -(-(40 + 9 * 15) // 16),)  # 8 experts + idle
    real = sorted_pairs < 40
    assert sorted(sorted_pairs[real].tolist()) == list(range(40))
    row_experts = block_experts.long().repeat_interleave(16)
    assert torch.equal(row_experts[real], flat[sorted_pairs[real].long()])
    used = block_experts[block_experts >= 0]
    assert used.tolist() == sorted(used.tolist()) and 7 not in used.tolist()
    assert (block_experts[len(used):] == -1).all()  # idle blocks only at the end


def test_pairs_with_no_expert_sit_in_idle_blocks_and_give_zero():
    """id == num_experts (the empty rows of expert parallelism's fixed-capacity buffers)."""
    x, ids, weights, w13, w2 = _moe_case()
    ids[::3, 1] = 8  # every third token's second pair has no expert
    sorted_pairs, block_experts = align_by_expert(ids, 8, 16)
    row_experts = block_experts.long().repeat_interleave(16)
    idle = (ids.reshape(-1) == 8).nonzero().reshape(-1)
    at = torch.isin(sorted_pairs.long(), idle)
    assert int(at.sum()) == idle.numel() and (row_experts[at] == -1).all()
    out = fused_moe_ref(x, ids, weights, w13, w2)
    kept = ids[:, :1]  # the same tokens through their first expert alone
    torch.testing.assert_close(out[::3], fused_moe_ref(x, kept, weights[:, :1], w13, w2)[::3],
                               atol=1e-6, rtol=1e-6)


def test_reference_is_the_weighted_sum_of_experts():
    x, ids, weights, w13, w2 = _moe_case(num_tokens=3)
    out = fused_moe_ref(x, ids, weights, w13, w2)
    for t in range(3):
        expected = 0
        for j in range(2):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            expected = expected + weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_weights,with_idle", [(True, False), (False, False), (True, True)])
def test_triton_matches_reference(device, with_weights, with_idle):
    from duplex.kernels.fused_moe import fused_moe_triton
    x, ids, weights, w13, w2 = _moe_case()
    if with_idle:
        ids[1::2, 0] = 8  # pairs with no expert: output 0
    weights = weights if with_weights else None
    expected = fused_moe_ref(x, ids, weights, w13, w2)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = fused_moe_triton(on(x), on(ids), on(weights), on(w13), on(w2), block_m=16,
                           block_n=32, block_k=32).cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_large(dtype):
    from duplex.kernels.fused_moe import fused_moe_triton
    x, ids, weights, w13, w2 = (t.cuda() for t in _moe_case(
        num_tokens=300, num_experts=64, top_k=6, hidden=1024, inter=512))
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    torch.testing.assert_close(fused_moe_triton(x, ids, weights, w13, w2),
                               fused_moe_ref(x, ids, weights, w13, w2), atol=3e-2, rtol=3e-2)
