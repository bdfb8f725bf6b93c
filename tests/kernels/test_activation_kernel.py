"""SiLU-and-mul: the triton kernel against the torch reference."""
import pytest
import torch

from duplex.kernels.activation import silu_and_mul_ref


def test_reference_is_silu_of_gate_times_up():
    x = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.silu(x[:, :5]) * x[:, 5:]
    assert torch.equal(silu_and_mul_ref(x), expected)


def test_reference_rejects_odd_width_in_plain_words():
    with pytest.raises(AssertionError, match=r"must be \[..., 2n\]"):
        silu_and_mul_ref(torch.zeros(2, 5))


@pytest.mark.parametrize("shape, block", [((2, 3, 40), 1024), ((5, 96), 16), ((0, 8), 1024)])
def test_triton_matches_reference(device, shape, block):
    from duplex.kernels.activation import silu_and_mul_triton
    x = 3 * torch.randn(shape, generator=torch.Generator().manual_seed(1))
    got = silu_and_mul_triton(x.to(device), block=block).cpu()
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got, silu_and_mul_ref(x), atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_large(dtype):
    from duplex.kernels.activation import silu_and_mul_triton
    x = torch.randn(4096, 2 * 11008, device="cuda", dtype=dtype)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), atol=1e-2,
                               rtol=1e-2)
