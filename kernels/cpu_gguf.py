"""GGUF block-quantized weights read from their own bytes (kernels/cpu_gguf.c).

    raw = uint8 [N, row_bytes]   the file's rows, each a run of ggml blocks (TYPES)
    w = dequant(type_id, raw, k)             -> fp32 [N, k]
    y = linear(type_id, raw, k, x)           x [M, k] fp32 -> [M, N] fp32, for a few rows

`linear` on a block type (Q4_0 ... Q6_K) quantizes x to int8 with one scale per 32 inputs
(K-quants: per 256, `x_group`), as llama.cpp does, and sums weights and activations in
integers, straight from the blocks with AVX2 (one C call, gg_linear_x; `quantize_x` is the
quantization alone, which the tests hold the kernel to); F16/BF16/F32 rows are dotted in
fp32. K-quants take 512-bit dots with AVX-512 VNNI, and from AMX_ROWS rows of x AMX-INT8
tiles where the CPU has them (a decode batch of 16: 2-2.4x the VNNI loop;
DUPLEX_GGUF_AMX=0 turns them off).

The C library is portable (no AVX512 needed). Without a C compiler (or DUPLEX_GGUF_C=0) the
same functions run on the `gguf` package's numpy dequantizers, which are also the reference
the tests hold the C code to.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from duplex.kernels import switches
from duplex.kernels.cpu_fused import load_library

# ggml type id -> (name, weights per block, bytes per block)
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
         6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
         13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}
TYPE_IDS = {name: type_id for type_id, (name, _, _) in TYPES.items()}
_SOURCE = Path(__file__).with_name("cpu_gguf.c")
_lib: ctypes.CDLL | None | bool = None
_P, _I = ctypes.c_void_p, ctypes.c_int64


def row_bytes(type_id: int, k: int) -> int:
    """Bytes of one row of k weights; asserts k is whole blocks of a known type."""
    assert type_id in TYPES, f"GGUF type {type_id} has no kernel (known: {sorted(TYPES)})"
    _, block, nbytes = TYPES[type_id]
    assert k % block == 0, f"{TYPES[type_id][0]} rows need K divisible by {block}, got {k}"
    return k // block * nbytes


def available() -> bool:
    return not switches.is_off("DUPLEX_GGUF_C") and _load() is not False


def dequant(type_id: int, raw: torch.Tensor, k: int, out: torch.Tensor | None = None,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """raw uint8 `[N, row_bytes]` -> `[N, k]` fp32 or bf16 (into `out` when given, whose
    dtype then decides). bf16 is the fp32 weights rounded to nearest even, written directly
    (half the bytes of a tile, and no second pass to convert them)."""
    _check(type_id, raw, k)
    out = torch.empty(raw.shape[0], k, dtype=dtype) if out is None else out
    assert out.shape == (raw.shape[0], k) and out.dtype in (torch.float32, torch.bfloat16) \
        and out.is_contiguous(), f"out must be contiguous fp32/bf16 [{raw.shape[0]}, {k}]"
    if not available():
        out.copy_(reference_dequant(type_id, raw, k))
        return out
    fn = _load().gg_dequant if out.dtype == torch.float32 else _load().gg_dequant_bf16
    rc = fn(type_id, raw.data_ptr(), raw.shape[1], raw.shape[0], k, out.data_ptr(), k,
            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"gg_dequant refused {TYPES[type_id][0]} [{raw.shape[0]}, {k}]")
    return out


def linear(type_id: int, raw: torch.Tensor, k: int, x: torch.Tensor, fp32_x: bool = False,
           lanes: bool = False, split_x: bool = False) -> torch.Tensor:
    """x `[M, k]` fp32 (last dim contiguous) @ w.T -> `[M, N]` fp32. Block types round x to
    int8 (one scale per x_group inputs) unless fp32_x: then each weight row is dequantized
    and dotted with x in fp32 (gg_linear), the fp32 reference's sums up to their order.
    split_x: x in two int8 parts, the second the first's rounding error (gg_linear_x2), so
    x is off by at most 1/64516 of its group's max (an output head's prompt rows).
    lanes (K-quants where `lanes_available`): the AVX-512 VNNI kernel with weight rows in the
    lanes, or the AVX2 one with rows of x in them, at every M, so a row's bits do not depend
    on M (gg_linear_lanes)."""
    _check(type_id, raw, k)
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1, (
        f"x must be fp32 [M, {k}] with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    if not available():
        return x @ reference_dequant(type_id, raw, k).T
    out = torch.empty(x.shape[0], raw.shape[0], dtype=torch.float32)
    if TYPES[type_id][1] == 1 or fp32_x:  # F16 / BF16 / F32 (or asked): fp32 dots
        rc = _load().gg_linear(type_id, raw.data_ptr(), raw.shape[1], raw.shape[0], k,
                               x.data_ptr(), x.stride(0), x.shape[0], out.data_ptr(),
                               raw.shape[0], torch.get_num_threads())
    elif lanes:
        rc = _load().gg_linear_lanes(type_id, raw.data_ptr(), raw.shape[1], raw.shape[0], k,
                                     x.data_ptr(), x.stride(0), x.shape[0], out.data_ptr(),
                                     raw.shape[0], torch.get_num_threads())
    else:
        # quantize_x and the int8 dots in one call (gg_linear_x; x2: in two parts)
        fn = _load().gg_linear_x2 if split_x else _load().gg_linear_x
        rc = fn(type_id, raw.data_ptr(), raw.shape[1], raw.shape[0], k, x.data_ptr(),
                x.stride(0), x.shape[0], out.data_ptr(), raw.shape[0], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"gg_linear refused {TYPES[type_id][0]} [{raw.shape[0]}, {k}]")
    return out


def unblock_bf16(blocked: torch.Tensor, m: int) -> torch.Tensor:
    """bf16 `[blocks, n, size]` (the bf16 GEMM's output: per block of `size` rows of x, n
    columns of `size`) -> its first m rows `[m, n]`, contiguous:
    `blocked.transpose(1, 2).reshape(-1, n)[:m]`, in one C pass (16 x 32 tiles with AVX-512)."""
    blocks, n, size = blocked.shape
    assert blocked.dtype == torch.bfloat16 and blocked.is_contiguous() and 1 <= m <= blocks * size
    if not available():
        return blocked.transpose(1, 2).reshape(blocks * size, n)[:m].contiguous()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if _load().gg_unblock_bf16(blocked.data_ptr(), blocks, n, size, m, out.data_ptr(),
                               torch.get_num_threads()) != 0:
        raise RuntimeError(f"gg_unblock_bf16 refused {tuple(blocked.shape)} -> {m} rows")
    return out


def gemm_bf16(type_id: int, raw: torch.Tensor, k: int, x: torch.Tensor) -> torch.Tensor | None:
    """x `[M, k]` bf16 (rows contiguous) @ w.T -> `[M, N]` bf16 on AMX-BF16 tiles or with
    AVX512-BF16 (`bf16_gemm_kind`), the weights dequantized a panel at a time into the cache
    (gg_gemm_bf16: every output one fp32 sum in one order whatever M, rounded once); None where
    neither kernel runs (no such CPU, the switches off, k not a multiple of 32)."""
    _check(type_id, raw, k)
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1
    if k % 32 or bf16_gemm_kind() is None:
        return None
    out = torch.empty(x.shape[0], raw.shape[0], dtype=torch.bfloat16)
    if _load().gg_gemm_bf16(type_id, raw.data_ptr(), raw.shape[1], raw.shape[0], k, x.data_ptr(),
                            x.stride(0), x.shape[0], out.data_ptr(), raw.shape[0],
                            torch.get_num_threads()) != 0:
        raise RuntimeError(f"gg_gemm_bf16 refused {TYPES[type_id][0]} [{raw.shape[0]}, {k}]")
    return out


def bf16_gemm_kind() -> str | None:
    """Which kernel runs `gemm_bf16` here: "amx" (AMX-BF16 tiles: built with them, Linux gave
    this process the tile state, DUPLEX_GGUF_AMX not 0), "avx512" (AVX512-BF16 without AMX,
    DUPLEX_GGUF_BF16_GEMM not 0), or None."""
    lib = _load() if available() else None
    return {1: "amx", 2: "avx512"}.get(lib.gg_gemm_bf16_kind()) if lib else None


def amx_bf16_available() -> bool:
    """Whether prompt GEMMs run on AMX-BF16 tiles here (`gemm_bf16`)."""
    return bf16_gemm_kind() == "amx"


# gg_peak's kinds: the instruction each kernel's inner loop is built on
PEAK_KINDS = {"bf16": 0, "int8": 1, "int8-256": 2, "fp32-256": 3, "int8-avx2": 4}


def peak_ops(kind: str, threads: int, iters: int = 10_000_000) -> float | None:
    """Operations a second (2 a multiply-add, all threads together) of the instruction a
    kernel is built on, issued back to back into independent accumulators on `threads`
    threads (cpu_gguf.c gg_peak): "bf16" 512-bit vdpbf16ps (the AVX512-BF16 prompt GEMM),
    "int8" 512-bit vpdpbusd (the VNNI kernels), "int8-256" its 256-bit form; on AVX2
    "fp32-256" 256-bit vfmadd231ps (the fp32 GEMM of prompt tiles) and "int8-avx2"
    vpmaddubsw + vpmaddwd + vpaddd (the AVX2 row kernels' dot). The most that kernel's
    arithmetic can do on this box; None where the library has no such kernel."""
    lib = _load() if available() else None
    rate = lib.gg_peak(PEAK_KINDS[kind], threads, iters) if lib else -1.0
    return rate if rate > 0 else None


def x_group(type_id: int) -> int:
    """Inputs per activation scale in the int8 kernels: 32, and 256 for the K-quants (one
    scale a block, llama.cpp's Q8_K, so a block's sub-block sums stay in integers)."""
    return 256 if TYPES[type_id][1] == 256 else 32


def quantize_x(x: torch.Tensor, group: int = 32
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x `[M, k]` fp32 -> xq int8 `[M, k]` = round(x / dx), dx fp32 `[M, k/group]` = max|x| /
    127 over each group (32 or 256), xs int32 `[M, k/16]` = sums of xq over each 16 (the C
    library's)."""
    m, k = x.shape
    assert group in (32, 256) and k % group == 0 and x.stride(1) == 1, (
        f"x [M, {group}j] with contiguous rows, got {tuple(x.shape)}")
    xq = torch.empty(m, k, dtype=torch.int8)
    dx = torch.empty(m, k // group, dtype=torch.float32)
    xs = torch.empty(m, k // 16, dtype=torch.int32)
    if _load().gg_quantize_x(x.data_ptr(), x.stride(0), m, k, group, xq.data_ptr(),
                             dx.data_ptr(), xs.data_ptr()) != 0:
        raise RuntimeError(f"gg_quantize_x refused x {tuple(x.shape)}")
    return xq, dx, xs


def reference_dequant(type_id: int, raw: torch.Tensor, k: int) -> torch.Tensor:
    """The `gguf` package's numpy dequantizer on the same bytes: fp32 `[N, k]`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw.numpy(), GGMLQuantizationType(type_id))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(raw.shape[0], k))


def _check(type_id: int, raw: torch.Tensor, k: int) -> None:
    assert raw.dtype == torch.uint8 and raw.dim() == 2 and raw.is_contiguous(), (
        f"raw must be contiguous uint8 [N, row_bytes], got {raw.dtype} {tuple(raw.shape)}")
    assert raw.shape[1] == row_bytes(type_id, k), (
        f"{TYPES[type_id][0]} rows of {k} weights are {row_bytes(type_id, k)} bytes, "
        f"got {raw.shape[1]}")


def _load():
    global _lib
    if _lib is None:
        _lib = load_library(_SOURCE, ["-fopenmp", "-ffp-contract=off"], (), _declare,
                             "GGUF CPU kernel")
    return _lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.gg_dequant.restype = lib.gg_linear.restype = lib.gg_linear_x.restype = ctypes.c_int
    lib.gg_dequant.argtypes = [ctypes.c_int, _P, _I, _I, _I, _P, _I, ctypes.c_int]
    lib.gg_dequant_bf16.restype = ctypes.c_int
    lib.gg_dequant_bf16.argtypes = lib.gg_dequant.argtypes
    lib.gg_linear.argtypes = [ctypes.c_int, _P, _I, _I, _I, _P, _I, _I, _P, _I, ctypes.c_int]
    lib.gg_linear_x.argtypes = lib.gg_linear.argtypes
    lib.gg_linear_x2.restype = ctypes.c_int
    lib.gg_linear_x2.argtypes = lib.gg_linear.argtypes
    lib.gg_linear_lanes.restype = ctypes.c_int
    lib.gg_linear_lanes.argtypes = lib.gg_linear.argtypes
    lib.gg_quantize_x.restype = lib.gg_linear_q8.restype = ctypes.c_int
    lib.gg_quantize_x.argtypes = [_P, _I, _I, _I, ctypes.c_int, _P, _P, _P]
    lib.gg_linear_q8.argtypes = [ctypes.c_int, _P, _I, _I, _I, _P, _P, _P, _I, _P, _I,
                                 ctypes.c_int]
    lib.gg_unblock_bf16.restype = ctypes.c_int
    lib.gg_unblock_bf16.argtypes = [_P, _I, _I, _I, _I, _P, ctypes.c_int]
    lib.gg_gemm_bf16.restype = lib.gg_gemm_bf16_kind.restype = ctypes.c_int
    lib.gg_gemm_bf16.argtypes = [ctypes.c_int, _P, _I, _I, _I, _P, _I, _I, _P, _I, ctypes.c_int]
    lib.gg_peak.restype = ctypes.c_double
    lib.gg_peak.argtypes = [ctypes.c_int, ctypes.c_int, _I]
    apply_amx_switch(lib)
    return lib


def apply_amx_switch(lib: ctypes.CDLL) -> None:
    """DUPLEX_GGUF_AMX=0, DUPLEX_GGUF_VN16=0, DUPLEX_GGUF_XL16=0, DUPLEX_GGUF_X8=0, DUPLEX_GGUF_BF16_GEMM=0 and
    DUPLEX_GGUF_KQ_PREFETCH=0 into a library built from cpu_gguf.c (this one,
    kernels.cpu_decode's): the AMX tiles off, the K-quants' AVX-512 kernel with weight rows in
    the lanes off, the one with rows of x in the lanes off, the AVX512-BF16 prompt GEMM off,
    the AVX2 row kernel's prefetch off. A library built without what a switch turns off has
    no such switch."""
    if hasattr(lib, "gg_set_amx"):
        lib.gg_set_amx.argtypes = [ctypes.c_int]
        lib.gg_set_amx(0 if switches.is_off("DUPLEX_GGUF_AMX") else 1)
    if hasattr(lib, "gg_set_vn"):
        lib.gg_set_vn.argtypes = [ctypes.c_int]
        lib.gg_set_vn(0 if switches.is_off("DUPLEX_GGUF_VN16") else 1)
    if hasattr(lib, "gg_set_xl"):
        lib.gg_set_xl.argtypes = [ctypes.c_int]
        lib.gg_set_xl(0 if switches.is_off("DUPLEX_GGUF_XL16") else 1)
    if hasattr(lib, "gg_set_bf16_gemm"):
        lib.gg_set_bf16_gemm.argtypes = [ctypes.c_int]
        lib.gg_set_bf16_gemm(0 if switches.is_off("DUPLEX_GGUF_BF16_GEMM") else 1)
    if hasattr(lib, "gg_set_x8"):
        lib.gg_set_x8.argtypes = [ctypes.c_int]
        lib.gg_set_x8(0 if switches.is_off("DUPLEX_GGUF_X8") else 1)
    if hasattr(lib, "gg_set_kq_prefetch"):
        lib.gg_set_kq_prefetch.argtypes = [ctypes.c_int]
        lib.gg_set_kq_prefetch(0 if switches.is_off("DUPLEX_GGUF_KQ_PREFETCH") else 1)


def amx_available() -> bool:
    """Whether the K-quants' matmuls of AMX_ROWS or more rows run on AMX-INT8 tiles here (the
    CPU has them, Linux gave this process their state, the switch is on)."""
    lib = _load() if available() else None
    return bool(lib) and hasattr(lib, "gg_amx_available") and lib.gg_amx_available() == 1


def vn_available() -> bool:
    """Whether the K-quants' matmuls of VN_ROWS or more rows take the AVX-512 VNNI kernel with
    16 weight rows in a register's lanes (cpu_gguf.c vn_linear): the CPU has AVX-512 VNNI and
    the library's switch is on (DUPLEX_GGUF_VN16, given it by apply_amx_switch). Where AMX-INT8
    runs, the tiles take 8 rows and more first."""
    lib = _load() if available() else None
    return bool(lib) and hasattr(lib, "gg_vn_available") and lib.gg_vn_available() == 1


def x8_available() -> bool:
    """Whether K-quant matmuls take the AVX2 kernel with 8 rows of x in a register's lanes
    (cpu_gguf.c x8_linear): a CPU with AVX2 and no AVX-512 VNNI, the switch DUPLEX_GGUF_X8
    on. gg_linear_q8 gives it 6 rows and more (X8_ROWS); gg_linear_lanes (int8 prompt steps)
    every row count."""
    lib = _load() if available() else None
    return bool(lib) and hasattr(lib, "gg_x8_available") and lib.gg_x8_available() == 1


def lanes_available() -> bool:
    """Whether `linear(..., lanes=True)` runs here (K-quants): the AVX-512 VNNI kernel with
    weight rows in the lanes, or the AVX2 one with rows of x in the lanes."""
    return vn_available() or x8_available()


def xl_takes(rows: int) -> bool:
    """Whether K-quant matmuls of `rows` rows of x take the AVX-512 VNNI kernel with 8 or 16
    rows of x in a register's lanes (cpu_gguf.c xl_linear: 5-8, 13-16 and 29-32 rows, no AMX,
    the switch DUPLEX_GGUF_XL16 on); its outputs are bitwise those of the kernel with weight
    rows in the lanes, so only this says which ran."""
    lib = _load() if available() else None
    if not lib or not hasattr(lib, "gg_xl_takes"):
        return False
    lib.gg_xl_takes.argtypes = [ctypes.c_int64]
    return lib.gg_xl_takes(rows) == 1


AMX_ROWS = 8  # cpu_gguf.c AMX_MIN_ROWS
VN_ROWS = 8  # cpu_gguf.c VN_MIN_ROWS
X8_ROWS = 6  # cpu_gguf.c X8_MIN_ROWS
