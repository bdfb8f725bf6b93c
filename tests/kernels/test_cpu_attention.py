"""kernels.cpu_attention (decode attention read in place from the paged cache) against the
reference, through the planned path that the engine calls while the fused kernels are on."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention
from kernels.attention import paged_attention_planned, paged_attention_ref, plan_attention
from kernels.cpu_fused import use_fused
from tests.kernels.kernel_factories import attention_args, make_paged_batch, naive_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="no C compiler or no AVX512 on this CPU")

SEQS = {
    "one decode": [(37, 1)],
    "decodes of unequal lengths": [(9, 1), (40, 1), (3, 1), (17, 1)],
    "one key": [(1, 1), (2, 1)],
    "mixed with prefills": [(17, 1), (25, 25), (33, 1), (21, 6), (7, 0)],
}


@pytest.mark.parametrize("heads", [(6, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("window", [None, 1, 8])
@pytest.mark.parametrize("name", list(SEQS))
def test_equals_the_reference(name, window, heads):
    batch = make_paged_batch(SEQS[name], num_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=32, seed=len(name) + heads[0])
    q_lens = (batch["query_start_loc"][1:] - batch["query_start_loc"][:-1]).tolist()
    plan = plan_attention(batch["block_tables"], q_lens, batch["seq_lens"].tolist(),
                          batch["k_cache"].shape[1], window)
    assert cpu_attention.fits(batch["q"], batch["k_cache"], None)
    with use_fused(True):
        out = paged_attention_planned(batch["q"], batch["k_cache"], batch["v_cache"], plan, 0.2)
    ref = paged_attention_ref(*attention_args(batch), 0.2, window)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.2, window), rtol=1e-4,
                               atol=1e-4)


def test_it_is_the_kernel_that_runs(monkeypatch):
    batch = make_paged_batch([(12, 1), (30, 1)], num_heads=4, num_kv_heads=2, head_dim=16)
    plan = plan_attention(batch["block_tables"], [1, 1], batch["seq_lens"].tolist(),
                          batch["k_cache"].shape[1])
    calls = []
    real = cpu_attention.decode
    monkeypatch.setattr(cpu_attention, "decode", lambda *a: calls.append(1) or real(*a))
    paged_attention_planned(batch["q"], batch["k_cache"], batch["v_cache"], plan, 0.3)
    assert calls == []  # the exact mode keeps SDPA
    with use_fused(True):
        paged_attention_planned(batch["q"], batch["k_cache"], batch["v_cache"], plan, 0.3)
    assert calls == [1]


def test_soft_cap_and_odd_head_dims_keep_the_torch_path():
    q = torch.randn(2, 4, 24)
    cache = torch.randn(3, 4, 2, 24)
    assert not cpu_attention.fits(q, cache, None)
    q, cache = torch.randn(2, 4, 32), torch.randn(3, 4, 2, 32)
    assert cpu_attention.fits(q, cache, None) and not cpu_attention.fits(q, cache, 30.0)
