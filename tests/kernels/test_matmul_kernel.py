"""Persistent triton matmul: matches torch, and row r does not depend on M (batch invariance)."""
import pytest
import torch

from duplex.kernels.matmul import linear_ref, linear_triton, matmul_triton


def _operands(m, k, n, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype),
            torch.randn(n, generator=gen).to(dtype))


def test_triton_matches_reference(device):
    x, weight, bias = (t.to(device) for t in _operands(70, 40, 72))
    got = linear_triton(x, weight, bias)
    torch.testing.assert_close(got.cpu(), linear_ref(x, weight, bias).cpu(), atol=1e-4, rtol=1e-5)


def test_triton_rows_independent_of_m_and_program_count(device):
    x, weight, _ = (t.to(device) for t in _operands(70, 40, 20))
    full = matmul_triton(x, weight.t(), num_programs=3)
    for m in (1, 5, 64, 65):
        assert torch.equal(matmul_triton(x[:m], weight.t(), num_programs=1), full[:m])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_large_batch_invariant(dtype):
    x, weight, bias = (t.cuda() for t in _operands(2048, 1536, 4096, dtype))
    full = linear_triton(x, weight, bias)
    torch.testing.assert_close(full, linear_ref(x, weight, bias), atol=5e-2, rtol=5e-2)
    for m in (1, 3, 64, 129, 1000):
        assert torch.equal(linear_triton(x[:m], weight, bias), full[:m])
