"""Machine figures every report starts with: measured fp32 GEMM GFLOP/s and memory bandwidth.

They set the ceiling a decode number is judged against: tokens/s × FLOPs/token over peak
GFLOP/s, and decode steps/s × weight bytes read per step over bandwidth. Decode steps/s is
taken as 1 / median ITL (in a batched engine every running stream advances once per step).
"""
from __future__ import annotations

import os
import platform
import time

# (M, N, K): SmolLM2-135M's MLP projection at decode batch 1 and 64, at a 512-token prefill,
# and a square GEMM for the machine's peak.
DEFAULT_GEMM_SHAPES: tuple[tuple[int, int, int], ...] = (
    (1, 1536, 576), (64, 1536, 576), (512, 1536, 576), (1024, 1024, 1024))
DEFAULT_COPY_BYTES = 256 * 2**20


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """"MxNxK,MxNxK" → ((M, N, K), ...)."""
    shapes = []
    for item in text.split(","):
        dims = tuple(int(d) for d in item.lower().strip().split("x"))
        if len(dims) != 3 or min(dims) < 1:
            raise ValueError(f"a GEMM shape is MxNxK with positive sizes, got {item!r}")
        shapes.append(dims)
    return tuple(shapes)


def matmul_gflops(m: int, n: int, k: int, device: str = "cpu", min_time_s: float = 0.2) -> float:
    """fp32 GFLOP/s of a [m, k] @ [k, n] matmul (2·m·n·k FLOPs), timed over >= min_time_s."""
    import torch
    a = torch.randn(m, k, device=device)
    b = torch.randn(k, n, device=device)
    out = torch.empty(m, n, device=device)
    seconds, iterations = _time_loop(lambda: torch.mm(a, b, out=out), device, min_time_s)
    return 2.0 * m * n * k * iterations / seconds / 1e9


def memory_bandwidth_gbs(num_bytes: int = DEFAULT_COPY_BYTES, device: str = "cpu",
                         min_time_s: float = 0.3) -> float:
    """GB/s of a large tensor copy, counting bytes read plus bytes written."""
    import torch
    src = torch.rand(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds, iterations = _time_loop(lambda: dst.copy_(src), device, min_time_s)
    return 2.0 * src.numel() * 4 * iterations / seconds / 1e9


def memory_read_gbs(num_bytes: int = DEFAULT_COPY_BYTES, device: str = "cpu",
                    min_time_s: float = 0.3) -> float:
    """GB/s of streaming reads: a sum over a large tensor, bytes read only."""
    import torch
    src = torch.ones(num_bytes // 4, device=device)
    seconds, iterations = _time_loop(src.sum, device, min_time_s)
    return src.numel() * 4 * iterations / seconds / 1e9


def _time_loop(fn, device: str, min_time_s: float) -> tuple[float, int]:
    fn()                                            # warm-up: allocation, thread pool
    _sync(device)
    iterations, start = 0, time.perf_counter()
    while True:
        fn()
        iterations += 1
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_time_s:
            return elapsed, iterations


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def measure_machine(shapes=DEFAULT_GEMM_SHAPES, device: str = "cpu",
                    copy_bytes: int = DEFAULT_COPY_BYTES) -> dict:
    import torch
    gemm = [{"m": m, "n": n, "k": k, "gflops": matmul_gflops(m, n, k, device)}
            for m, n, k in shapes]
    return {
        "device": device,
        "cpu": _cpu_name(),
        "num_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gemm": gemm,
        "peak_gflops": max(g["gflops"] for g in gemm),
        "bandwidth_gbs": memory_bandwidth_gbs(copy_bytes, device),
    }


def decode_utilization(summary: dict, machine: dict, gflop_per_token: float | None,
                       bytes_per_step: float | None) -> dict:
    """Decode throughput as a fraction of the machine's measured compute and bandwidth."""
    result: dict = {}
    if gflop_per_token:
        achieved = summary["output_throughput"] * gflop_per_token
        result |= {"gflop_per_token": gflop_per_token, "achieved_gflops": achieved,
                   "compute_fraction": achieved / machine["peak_gflops"]}
    itl_p50_ms = summary["itl_ms"].get("p50")
    if bytes_per_step and itl_p50_ms:
        achieved = bytes_per_step * (1e3 / itl_p50_ms) / 1e9
        result |= {"bytes_per_step": bytes_per_step, "achieved_gbs": achieved,
                   "bandwidth_fraction": achieved / machine["bandwidth_gbs"]}
    return result


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
