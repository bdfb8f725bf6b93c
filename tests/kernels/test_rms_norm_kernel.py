"""RMSNorm: the reference equals transformers' Llama/Gemma3 norms bitwise; triton matches it."""
import pytest
import torch

from duplex.kernels.rms_norm import rms_norm_ref

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
modeling_gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")


def _hf_norm(cls, weight, eps):
    norm = cls(weight.shape[0], eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_semantics_bitwise(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    residual = torch.randn(7, 96, generator=gen).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    hf = _hf_norm(modeling_llama.LlamaRMSNorm, weight, 1e-5)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, weight, 1e-5), hf(x))
        out, new_residual = rms_norm_ref(x, weight, 1e-5, residual=residual)
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(out, hf(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma3_semantics_bitwise(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    weight = (0.1 * torch.randn(64, generator=gen)).to(dtype)
    hf = _hf_norm(modeling_gemma3.Gemma3RMSNorm, weight, 1e-6)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, weight, 1e-6, offset=1.0), hf(x))


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_matches_reference(device, offset, with_residual):
    from duplex.kernels.rms_norm import rms_norm_triton
    gen = torch.Generator().manual_seed(2)
    x, residual = torch.randn(2, 3, 40, generator=gen), torch.randn(2, 3, 40, generator=gen)
    weight = torch.randn(40, generator=gen)
    residual = residual if with_residual else None
    expected = rms_norm_ref(x, weight, 1e-6, residual, offset)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = rms_norm_triton(on(x), on(weight), 1e-6, on(residual), offset)
    expected, got = (expected, got) if with_residual else ((expected,), (got,))
    for e, g in zip(expected, got):
        torch.testing.assert_close(g.cpu(), e, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_large(dtype):
    from duplex.kernels.rms_norm import rms_norm_triton
    x, residual = (torch.randn(4096, 4096, device="cuda", dtype=dtype) for _ in range(2))
    weight = torch.randn(4096, device="cuda", dtype=dtype)
    out, new_residual = rms_norm_triton(x, weight, 1e-6, residual)
    expected, expected_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
