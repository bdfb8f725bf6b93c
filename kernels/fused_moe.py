"""Fused mixture-of-experts: routed SwiGLU experts as two grouped GEMMs over tokens sorted
by expert.

    x [T, hidden], topk_ids [T, k], topk_weights [T, k] (or None: weight 1)
    w13 [E, 2 * inter, hidden] (gate rows, then up rows), w2 [E, hidden, inter]
    out[t] = sum_j  weight[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]

Each (token, j) pair is one row. The rows are sorted by expert and every expert's group is
padded to a whole number of BLOCK_M rows (`align_by_expert`), so a block of rows has one
expert and the GEMMs read that expert's weights once per block:

    sorted_pairs  int32 [P]           pair index of each sorted row; `T * k` marks padding
    block_experts int32 [P / BLOCK_M] the expert of each block; -1: idle (no expert)

A pair whose id is `E` has no expert: it lands in an idle group and its output is 0 (the
fixed-capacity buffers of expert parallelism mark their empty rows so).

    kernel 1, program (block, inter tile): x rows @ w13[e] gate and up tiles, SiLU-and-mul
        -> h [P, inter] (sorted order)
    kernel 2, program (block, hidden tile): h rows @ w2[e], times the pair's routing
        weight -> per-pair output [T * k, hidden]

The k outputs of a token are then summed left to right in top-k order (as the engine's
`combine` does). Rounding follows the reference: projections, silu and the weighted product
are rounded to x's dtype where torch's `silu(gate) * up` and `y * weight` would be; sums
are fp32. The alignment is all device ops: no host sync.
"""
import torch

from duplex.kernels._triton import require_triton, tl, triton


def fused_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None,
                  w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Torch reference: rows grouped by expert, one GEMM pair per expert that has rows."""
    _check(x, topk_ids, topk_weights, w13, w2)
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[2]
    ids = topk_ids.reshape(-1)
    rows = x.repeat_interleave(top_k, dim=0)  # [T * k, hidden], (token, j) order
    out = torch.empty_like(rows)
    out[ids == w13.shape[0]] = 0  # pairs with no expert
    for expert in torch.unique(ids[ids < w13.shape[0]]).tolist():
        mine = (ids == expert).nonzero(as_tuple=True)[0]
        gate, up = torch.nn.functional.linear(rows[mine], w13[expert]).split(inter, dim=-1)
        out[mine] = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[expert])
    out = out.view(num_tokens, top_k, -1)
    if topk_weights is not None:
        out = out * topk_weights.to(x.dtype)[:, :, None]
    total = out[:, 0]
    for j in range(1, top_k):
        total = total + out[:, j]
    return total


def _check(x, topk_ids, topk_weights, w13, w2) -> None:
    assert x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}"
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0], (
        f"topk_ids must be [num_tokens={x.shape[0]}, k], got {tuple(topk_ids.shape)}")
    assert topk_weights is None or topk_weights.shape == topk_ids.shape, (
        f"topk_weights must match topk_ids {tuple(topk_ids.shape)}, got "
        f"{tuple(topk_weights.shape)}")
    num_experts, two_inter, hidden = w13.shape
    assert hidden == x.shape[1] and two_inter % 2 == 0, (
        f"w13 must be [num_experts, 2 * inter, hidden={x.shape[1]}], got {tuple(w13.shape)}")
    assert w2.shape == (num_experts, hidden, two_inter // 2), (
        f"w2 must be [num_experts={num_experts}, hidden={hidden}, inter={two_inter // 2}], "
        f"got {tuple(w2.shape)}")


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs int32 [P], block_experts int32 [P / block_m]) for `topk_ids [T, k]`
    (see the module docstring; an id of `num_experts` is a pair with no expert). P is the
    worst case, `T * k + (E + 1) * (block_m - 1)` rounded up to block_m, so that no count has
    to come back to the host (nor does torch.bincount's, which CUDA reads the max of)."""
    ids = topk_ids.reshape(-1).long()
    num_pairs = ids.numel()
    device = ids.device
    num_groups = num_experts + 1  # the last: pairs with no expert, in idle blocks
    counts = torch.zeros(num_groups, dtype=torch.long, device=device).scatter_add_(
        0, ids, torch.ones_like(ids))  # [E + 1]
    padded = (counts + block_m - 1) // block_m * block_m
    group_end = torch.cumsum(padded, 0)  # [E + 1]: end of each group, padded
    order = torch.argsort(ids, stable=True)  # pairs grouped by expert, in pair order
    sorted_ids = ids[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_ids]
    num_rows = -(-(num_pairs + num_groups * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((num_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[(group_end - padded)[sorted_ids] + rank] = order.int()
    block_start = torch.arange(0, num_rows, block_m, device=device)
    block_experts = torch.searchsorted(group_end, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).int()
    return sorted_pairs, block_experts


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, h_ptr, sorted_ptr, block_experts_ptr, num_pairs, top_k,
                    hidden, inter, stride_x, stride_w_expert, stride_w_row, stride_h,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    FP32_DOT: tl.constexpr):
    """Program (row block, inter tile): h = silu(x @ gate.T) * (x @ up.T) of one expert."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    row_ok = pairs < num_pairs  # padding rows (and every row of an idle block) are off
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_base = w13_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_w_expert
    k_end = tl.where(expert >= 0, hidden, 0)  # an idle block skips the GEMM
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :] * stride_w_row + ks[:, None], mask=w_mask,
                         other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(w_base + (inter + cols)[None, :] * stride_w_row + ks[:, None],
                       mask=w_mask, other=0.0)
        if FP32_DOT:
            acc_gate += tl.dot(a, w_gate, input_precision="ieee")
            acc_up += tl.dot(a, w_up, input_precision="ieee")
        else:
            acc_gate += tl.dot(a, w_gate)
            acc_up += tl.dot(a, w_up)
    dtype = h_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = act * acc_up.to(dtype).to(tl.float32)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :], h.to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, out_ptr, weights_ptr, sorted_ptr, block_experts_ptr, num_pairs,
                 hidden, inter, stride_h, stride_w_expert, stride_w_row, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_WEIGHTS: tl.constexpr, FP32_DOT: tl.constexpr):
    """Program (row block, hidden tile): out[pair] = (h @ w2[e].T) * routing weight."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    row_ok = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w2_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_w_expert
    k_end = tl.where(expert >= 0, inter, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_w_row + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if FP32_DOT:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype)
    if HAS_WEIGHTS:
        weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(dtype)
        y = (y.to(tl.float32) * weight.to(tl.float32)[:, None]).to(dtype)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :], y,
             mask=row_ok[:, None] & col_ok[None, :])


def fused_moe_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None,
                     w13: torch.Tensor, w2: torch.Tensor, block_m: int = 64, block_n: int = 64,
                     block_k: int = 64) -> torch.Tensor:
    """Triton launcher; same contract as `fused_moe_ref`. Tile sizes: powers of two >= 16."""
    _check(x, topk_ids, topk_weights, w13, w2)
    tensors = (x, topk_ids, w13, w2) + (() if topk_weights is None else (topk_weights,))
    require_triton(*tensors)
    assert x.dtype == w13.dtype == w2.dtype, (
        f"x, w13, w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, (
        "x, w13 and w2 must be contiguous along their last dim")
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    sorted_pairs, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_experts.shape[0]
    h = torch.empty((sorted_pairs.shape[0], inter), dtype=x.dtype, device=x.device)
    fp32 = x.dtype == torch.float32
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, h, sorted_pairs, block_experts, num_pairs, top_k, hidden, inter, x.stride(0),
        w13.stride(0), w13.stride(1), h.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, FP32_DOT=fp32)
    pair_out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    weights = None if topk_weights is None else topk_weights.reshape(-1).float().contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w2, pair_out, pair_out if weights is None else weights, sorted_pairs, block_experts,
        num_pairs, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_WEIGHTS=weights is not None,
        FP32_DOT=fp32)
    pair_out = pair_out.view(num_tokens, top_k, hidden)
    total = pair_out[:, 0]
    for j in range(1, top_k):
        total = total + pair_out[:, j]
    return total
