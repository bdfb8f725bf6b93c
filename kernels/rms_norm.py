"""RMSNorm, optionally fused with the residual add that precedes it.

Semantics are Hugging Face's exactly:
* Llama (`offset=0.0`): `h = x.float(); h *= rsqrt(mean(h^2) + eps); out = weight * h.to(x.dtype)`.
* Gemma3 (`offset=1.0`): `out = (h * (1.0 + weight.float())).to(x.dtype)`, all in fp32.
With `residual`, `x = x + residual` first (in x's dtype) and the sum is returned as the new
residual: `(out, x + residual)`.
"""
import torch

from kernels._triton import require_triton, tl, triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, offset: float = 0.0):
    """Torch reference. Returns `out`, or `(out, new_residual)` when `residual` is given."""
    _check(x, weight, residual)
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        out = (h * (offset + weight.float())).to(dtype)
    else:
        out = weight * h.to(dtype)
    return out if residual is None else (out, x)


def _check(x, weight, residual) -> None:
    assert weight.dim() == 1 and x.shape[-1] == weight.shape[0], (
        f"weight must be [hidden={x.shape[-1]}], got {tuple(weight.shape)}")
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (
            f"residual must match x ({tuple(x.shape)}, {x.dtype}), got "
            f"({tuple(residual.shape)}, {residual.dtype})")
