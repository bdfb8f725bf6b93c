"""Quantized linear layers for a few rows on AVX512-VNNI CPUs (kernels/cpu_qgemv.c).

    layout = pack_int4(q, scale, zero)     q [N, K] uint8 in [0, 16), scale/zero [N, K/32]
    layout = pack_int8(q, scale)           q [N, K] int8, scale [N]
    y = linear(layout, x)                  x [M, K] fp32 -> [M, N] fp32

Activations are quantized to int8 with one scale per 32 inputs (what llama.cpp does for its
Q4/Q8 dot products), so the results differ from `dequantize() @ x` by that rounding: the
tests bound the error against the fp32 reference, and `duplex bench quality` measures what
it does to the model. Torch's weight-only kernels dequantize every weight to float per row
and read ~10 GB/s on this box; this one multiplies bytes with `vpdpbusd` and shares each
unpacked weight across the rows (figures in docs/BENCHMARKS.md).

`available()` is False without a C compiler, without AVX512-VNNI or with DUPLEX_QGEMV=0;
callers then keep torch's kernels. The library is built with -fopenmp against the libgomp that torch has
already loaded (one thread pool for both).
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from duplex.kernels import memory, switches
from duplex.kernels.cpu_fused import load_library

log = logging.getLogger("duplex.kernels")

GROUP = 32
BLOCK_ROWS = 16
INT4, INT8, INT4_HALF = 4, 8, 14  # the kernel's weight kinds (cpu_qgemv.c)
_SOURCE = Path(__file__).with_name("cpu_qgemv.c")
_lib: ctypes.CDLL | None | bool = None
_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class Packed:
    """A weight in the kernel's layout; `kind` INT4, INT4_HALF or INT8, logical shape `[n, k]`."""
    kind: int
    n: int
    k: int
    weight: torch.Tensor  # uint8, blocks of 16 rows (see cpu_qgemv.c)
    scale: torch.Tensor  # INT4 fp32 [n/16, k/32, 16]; INT4_HALF fp16 [n/16, k/32, 2, 16]
    #                      (scales, then mins); INT8 fp32 [n]
    zero: torch.Tensor | None  # INT4 fp32 [n/16, k/32, 16]

    @property
    def bits(self) -> int:
        return 8 if self.kind == INT8 else 4

    @property
    def pointers(self) -> tuple[int, int, int, int]:
        """(kind, weight, scale, zero) as the kernel takes them (the tensors never move)."""
        return (self.kind, self.weight.data_ptr(), self.scale.data_ptr(),
                0 if self.zero is None else self.zero.data_ptr())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.zero)
                   if t is not None)


def available() -> bool:
    """Whether the kernel runs here (DUPLEX_QGEMV=0 turns it off, for comparisons)."""
    return not switches.is_off("DUPLEX_QGEMV") and _load() is not False


def fits(n: int, k: int) -> bool:
    return n % BLOCK_ROWS == 0 and k % GROUP == 0


def _steps(q: torch.Tensor) -> torch.Tensor:
    """[N, K] bytes -> [N/16, K/32, 8, 64]: per block and group, 8 operands of 16 rows x 4."""
    n, k = q.shape
    return q.reshape(n // BLOCK_ROWS, BLOCK_ROWS, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4) \
        .reshape(n // BLOCK_ROWS, k // GROUP, 8, 64)


def _per_block(t: torch.Tensor) -> torch.Tensor:
    """[N, G] -> [N/16, G, 16] fp32 contiguous."""
    n, g = t.shape
    return t.float().reshape(n // BLOCK_ROWS, BLOCK_ROWS, g).permute(0, 2, 1).contiguous()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Packed:
    """int4 with w = (q - 8) * scale + zero. Where every scale and every min = zero - 8 *
    scale is exactly an IEEE half and min + 8 * scale gives zero back in fp32 (a GGUF Q4_0 /
    Q4_1 file's own d and m do), the kernel reads them as halves (INT4_HALF: 20 bytes per 32
    weights instead of 24, bitwise the same results)."""
    assert q.dtype == torch.uint8 and fits(*q.shape), f"int4 q [16a, 32b] uint8, got {q.shape}"
    s = _steps(q)
    nibbles = memory.empty(s[:, :, :4].shape, torch.uint8)  # streamed every step: huge pages
    torch.bitwise_or(s[:, :, :4], s[:, :, 4:] << 4, out=nibbles)  # low: steps 0-3, high: 4-7
    scale, zero = scale.float(), zero.float()
    low = zero - 8 * scale
    if _is_half(scale) and _is_half(low) and bool((low + 8 * scale == zero).all()):
        pairs = torch.stack([_per_block(scale), _per_block(low)], 2)  # [n/16, k/32, 2, 16]
        return Packed(INT4_HALF, q.shape[0], q.shape[1], nibbles, pairs.half().contiguous(), None)
    return Packed(INT4, q.shape[0], q.shape[1], nibbles, _per_block(scale), _per_block(zero))


def _is_half(t: torch.Tensor) -> bool:
    """Every value exactly an IEEE half (finite)."""
    h = t.half()
    return bool(torch.isfinite(h).all()) and bool((h.float() == t).all())


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> Packed:
    assert q.dtype == torch.int8 and fits(*q.shape), f"int8 q [16a, 32b] int8, got {q.shape}"
    unsigned = (q.to(torch.int16) + 128).to(torch.uint8)  # vpdpbusd takes unsigned weights
    steps = _steps(unsigned)
    weight = memory.empty(steps.shape, torch.uint8)
    weight.copy_(steps)
    return Packed(INT8, q.shape[0], q.shape[1], weight, scale.float().contiguous(), None)


def linear(p: Packed, x: torch.Tensor, pointers: tuple[int, int, int, int] | None = None
           ) -> torch.Tensor:
    """x `[M, K]` fp32 (rows may be strided, last dim contiguous) -> `[M, N]` fp32.
    `pointers`: `p.pointers`, kept by a caller that calls often (it costs a few µs)."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == p.k and x.stride(1) == 1
    m = x.shape[0]
    out = torch.empty(m, p.n, dtype=torch.float32)
    rc = _load().qg_linear(*(pointers or p.pointers), x.data_ptr(), x.stride(0), out.data_ptr(),
                           p.n, m, p.n, p.k, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"qg_linear refused int{p.bits} [{p.n}, {p.k}] x {tuple(x.shape)}")
    return out


def _load():
    global _lib
    if _lib is None:
        _lib = load_library(_SOURCE, ["-fopenmp"], (), _declare, "quantized CPU kernel")
    return _lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL | bool:
    lib.qg_available.restype = ctypes.c_int
    lib.qg_linear.restype = ctypes.c_int
    lib.qg_linear.argtypes = [ctypes.c_int, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I,
                              ctypes.c_int]
    if not lib.qg_available():
        log.info("CPU without AVX512-VNNI: quantized matmuls use torch's kernels")
        return False
    return lib
