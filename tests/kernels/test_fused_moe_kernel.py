"""Fused MoE: the expert alignment exactly, the triton grouped GEMMs against the reference."""
import pytest
import torch

from kernels.fused_moe import align_by_expert, fused_moe_ref


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
    assert sorted_pairs.shape == (16 * -(-(40 + 8 * 15) // 16),)
    real = sorted_pairs < 40
    assert sorted(sorted_pairs[real].tolist()) == list(range(40))
    row_experts = block_experts.long().repeat_interleave(16)
    assert torch.equal(row_experts[real], flat[sorted_pairs[real].long()])
    used = block_experts[block_experts >= 0]
    assert used.tolist() == sorted(used.tolist()) and 7 not in used.tolist()
    assert (block_experts[len(used):] == -1).all()  # idle blocks only at the end


def test_reference_is_the_weighted_sum_of_experts():
    x, ids, weights, w13, w2 = _moe_case(num_tokens=3)
    out = fused_moe_ref(x, ids, weights, w13, w2)
    for t in range(3):
        expected = 0
        for j in range(2):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            expected = expected + weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_weights", [True, False])
def test_triton_matches_reference(device, with_weights):
    from kernels.fused_moe import fused_moe_triton
    x, ids, weights, w13, w2 = _moe_case()
    weights = weights if with_weights else None
    expected = fused_moe_ref(x, ids, weights, w13, w2)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = fused_moe_triton(on(x), on(ids), on(weights), on(w13), on(w2), block_m=16,
                           block_n=32, block_k=32).cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_large(dtype):
    from kernels.fused_moe import fused_moe_triton
    x, ids, weights, w13, w2 = (t.cuda() for t in _moe_case(
        num_tokens=300, num_experts=64, top_k=6, hidden=1024, inter=512))
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    torch.testing.assert_close(fused_moe_triton(x, ids, weights, w13, w2),
                               fused_moe_ref(x, ids, weights, w13, w2), atol=3e-2, rtol=3e-2)
