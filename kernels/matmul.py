"""Matmul: the plain torch path, and a batch-invariant persistent triton kernel.

The triton kernel uses fixed tile sizes and one K-reduction order for every M, so row r of
`x @ w_t` is bitwise the same whatever the number of rows (invariant 8 on GPU).
"""
import torch

from duplex.kernels._triton import require_triton, tl, triton


def matmul_ref(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ w_t [K, N] -> [M, N]`."""
    return x @ w_t


def linear_ref(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [..., K] @ weight[N, K].T + bias -> [..., N]` (torch.nn.functional.linear)."""
    return torch.nn.functional.linear(x, weight, bias)


# Fixed for every call, whatever M: the tiles and the K order decide the rounding.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


@triton.jit
def _persistent_matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak,
                              stride_bk, stride_bn, stride_cm, stride_cn,
                              NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr):
    """Persistent: program p computes output tiles p, p + NUM_PROGRAMS, ... Each tile reduces
    over K in BLOCK_K steps from k = 0 upward, never split, so an output element's rounding
    depends only on its own row and column, not on M or on which program ran it."""
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * num_n
    rk = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        rm = (tile // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak,
                        mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
            b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,
                        mask=(k[:, None] < K) & (rn[None, :] < N), other=0.0)
            if FP32_DOT:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul_triton(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None,
                  num_programs: int | None = None) -> torch.Tensor:
    """Batch-invariant `x [M, K] @ w_t [K, N] (+ bias [N]) -> [M, N]` in x's dtype.
    `num_programs` defaults to the SM count (any value gives the same bits)."""
    assert x.dim() == 2 and w_t.dim() == 2 and x.shape[1] == w_t.shape[0], (
        f"x must be [M, K] and w_t [K, N], got {tuple(x.shape)} and {tuple(w_t.shape)}")
    assert x.dtype == w_t.dtype, f"x and w_t must share a dtype, got {x.dtype}, {w_t.dtype}"
    assert bias is None or (bias.shape == (w_t.shape[1],) and bias.is_contiguous()), (
        f"bias must be a contiguous [N={w_t.shape[1]}]")
    require_triton(x, w_t, *(() if bias is None else (bias,)))
    M, K = x.shape
    N = w_t.shape[1]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if num_programs is None:
        num_programs = (torch.cuda.get_device_properties(x.device).multi_processor_count
                        if x.is_cuda else 4)
    num_tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    num_programs = max(1, min(num_programs, num_tiles))
    _persistent_matmul_kernel[(num_programs,)](
        x, w_t, out, out if bias is None else bias, M, N, K, x.stride(0), x.stride(1),
        w_t.stride(0), w_t.stride(1), out.stride(0), out.stride(1), NUM_PROGRAMS=num_programs,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, HAS_BIAS=bias is not None,
        FP32_DOT=x.dtype == torch.float32)
    return out


def linear_triton(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant `x [..., K] @ weight [N, K].T + bias` through the persistent kernel."""
    assert weight.dim() == 2 and x.shape[-1] == weight.shape[1], (
        f"weight must be [N, K={x.shape[-1]}], got {tuple(weight.shape)}")
    out = matmul_triton(x.reshape(-1, x.shape[-1]), weight.t(), bias)
    return out.view(*x.shape[:-1], weight.shape[0])
