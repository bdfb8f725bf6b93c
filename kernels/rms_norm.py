"""RMSNorm, optionally fused with the residual add that precedes it.

Semantics are Hugging Face's exactly:
* Llama (`offset=0.0`): `h = x.float(); h *= rsqrt(mean(h^2) + eps); out = weight * h.to(x.dtype)`.
* Gemma3 (`offset=1.0`): `out = (h * (1.0 + weight.float())).to(x.dtype)`, all in fp32.
With `residual`, `x = x + residual` first (in x's dtype) and the sum is returned as the new
residual: `(out, x + residual)`.
"""
import torch

from duplex.kernels._triton import require_triton, tl, triton


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


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, stride_x,
                     stride_residual, eps, offset, N: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """One program per row. Residual add in the input dtype, statistics in fp32."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        tl.store(new_residual_ptr + row * N + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / N
    h = h * tl.math.rsqrt(variance + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if HAS_OFFSET:
        out = (h * (offset + weight.to(tl.float32))).to(out_ptr.dtype.element_ty)
    else:
        out = weight * h.to(x.dtype)
    tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, offset: float = 0.0):
    """Triton launcher; same contract as `rms_norm_ref`. Outputs are new contiguous tensors."""
    _check(x, weight, residual)
    require_triton(x, weight, *(() if residual is None else (residual,)))
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    assert x2.stride(-1) == 1, f"x rows must be contiguous, got strides {x.stride()}"
    assert weight.is_contiguous(), "weight must be contiguous"
    # Llama multiplies in the weight's dtype, which must then be x's for a same-dtype result
    assert offset or weight.dtype == x.dtype, (
        f"weight dtype {weight.dtype} must equal x dtype {x.dtype} (offset=0 semantics)")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = x2 if residual is None else residual.reshape(-1, hidden)
    assert res2.stride(-1) == 1, "residual rows must be contiguous"
    new_residual = torch.empty_like(out) if residual is not None else out
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, new_residual, x2.stride(0), res2.stride(0), eps,
            float(offset), N=hidden, BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None, HAS_OFFSET=bool(offset))
    out = out.view(x.shape)
    return out if residual is None else (out, new_residual.view(x.shape))
