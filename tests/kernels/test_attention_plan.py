"""The step-wide attention plan (kernels.attention.plan_attention): per layer only the key
gathers and the attention run; the result must be the reference's."""
from __future__ import annotations

import pytest
import torch

from duplex.kernels import ops
from duplex.kernels.attention import paged_attention_planned, paged_attention_ref, plan_attention
from tests.kernels.kernel_factories import (attention_args, make_paged_batch, naive_attention,
                                           pack_paged_batch)

SEQS = {
    "one decode": [(37, 1)],
    "decodes of unequal lengths": [(9, 1), (40, 1), (3, 1)],
    "prefill with a cached prefix": [(30, 12)],
    "mixed": [(17, 1), (25, 25), (33, 1), (21, 6)],
    "mixed with an idle sequence": [(9, 1), (5, 3), (1, 1), (12, 12), (17, 1), (7, 0), (20, 6)],
}


def _plan(batch, window):
    q_lens = (batch["query_start_loc"][1:] - batch["query_start_loc"][:-1]).tolist()
    return plan_attention(batch["block_tables"], q_lens, batch["seq_lens"].tolist(),
                          batch["k_cache"].shape[1], window)


@pytest.mark.parametrize("soft_cap", [None, 30.0])
@pytest.mark.parametrize("window", [None, 1, 8])
@pytest.mark.parametrize("name", list(SEQS))
def test_planned_attention_equals_the_reference(name, window, soft_cap):
    batch = make_paged_batch(SEQS[name], num_heads=6, num_kv_heads=2, seed=len(name))
    scale = 0.25
    out = paged_attention_planned(batch["q"], batch["k_cache"], batch["v_cache"],
                                  _plan(batch, window), scale, soft_cap)
    ref = paged_attention_ref(*attention_args(batch), scale, window, soft_cap)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), naive_attention(batch, scale, window, soft_cap),
                               rtol=1e-4, atol=1e-4)


def test_consecutive_blocks_are_read_as_a_view():
    torch.manual_seed(0)
    num_blocks, block_size = 6, 4
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, 2, 8)
    block_tables = torch.tensor([[2, 3, 4]], dtype=torch.int32)  # slots 8 .. 19
    plan = plan_attention(block_tables, [1], [11], block_size)
    assert plan.decode_span == slice(8, 19) and plan.decode_mask is None
    q = torch.randn(1, 4, 8)
    args = (q, k_cache, v_cache, block_tables, torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([11], dtype=torch.int32), 0.3)
    torch.testing.assert_close(ops.paged_attention(*args, plan=plan), paged_attention_ref(*args),
                               rtol=1e-6, atol=1e-6)
    shuffled = plan_attention(torch.tensor([[3, 2, 4]], dtype=torch.int32), [1], [11], block_size)
    assert shuffled.decode_span is None


@pytest.mark.parametrize("seq_len", [5, 300, 700, 1100])  # past the fused kernel's 512-key blocks
def test_a_whole_prompt_takes_the_causal_kernel_with_the_masks_bits(seq_len):
    """A prompt with no cached prefix is planned causal (the fused kernel's own mask, which
    skips the key blocks above the diagonal): bitwise the explicit mask's result, and each of
    its last rows bitwise the same computed after a prefix-cache hit (the mask path)."""
    torch.manual_seed(seq_len)
    k, v = torch.randn(2, seq_len, 2, 16).to(torch.bfloat16)
    q = torch.randn(seq_len, 6, 16).to(torch.bfloat16)
    cold = pack_paged_batch([(k, v, q)], block_size=16)
    plan = _plan(cold, None)
    assert plan.prefills[0].causal
    args = (cold["q"], cold["k_cache"], cold["v_cache"])
    out = paged_attention_planned(*args, plan, 0.25)
    masked = plan._replace(prefills=(plan.prefills[0]._replace(causal=False),))
    assert torch.equal(paged_attention_planned(*args, masked, 0.25), out)
    tail = max(2, seq_len // 3)
    warm = pack_paged_batch([(k, v, q[-tail:])], block_size=16)
    warm_plan = _plan(warm, None)
    assert not warm_plan.prefills[0].causal
    got = paged_attention_planned(warm["q"], warm["k_cache"], warm["v_cache"], warm_plan, 0.25)
    assert torch.equal(got, out[-tail:])
