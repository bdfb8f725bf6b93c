"""SiLU-and-mul, the SwiGLU activation of a fused gate/up projection, as one pass.

    gate_up [..., 2n]  ->  out [..., n] = silu(gate_up[..., :n]) * gate_up[..., n:]

silu is computed in fp32 and rounded to the input dtype before the product (torch's
semantics for `silu(gate) * up` in bf16/fp16); the product is rounded once.
"""
import torch

from duplex.kernels._triton import require_triton, tl, triton


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference."""
    _check(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _check(gate_up: torch.Tensor) -> None:
    assert gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0, (
        f"gate_up must be [..., 2n], got {tuple(gate_up.shape)}")


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n, BLOCK: tl.constexpr):
    """Program (row, column tile)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Triton launcher; same contract as `silu_and_mul_ref`. Returns a new contiguous tensor."""
    _check(gate_up)
    require_triton(gate_up)
    n = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * n)
    assert rows.stride(-1) == 1, f"gate_up rows must be contiguous, got strides {gate_up.stride()}"
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and n:
        block = min(block, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
            rows, out, rows.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)
