"""Decode attention read in place from the paged KV cache (kernels/cpu_attention.c).

    out = decode(q, k_cache, v_cache, plan, scale)   the plan's one-query sequences

The torch path (`attention.paged_attention_planned`) gathers each decode sequence's keys
and values into a padded copy, masks the padding and runs SDPA; at batch 64 that copying is
most of a decode step's attention time. This kernel walks the plan's slots instead, once
per (sequence, kv head) for all query heads of the group. It sums in another order than
SDPA and uses glibc's vector expf, so results differ from the reference by a few fp32 ulps:
`ops` calls it only while `cpu_fused.use_fused` is on (quantized weights), never in the
exact float32 mode or under batch invariance. fp32 caches, no soft cap, head_dim % 16 == 0.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from duplex.kernels import switches
from duplex.kernels.cpu_fused import cpu_flags, load_library

_SOURCE = Path(__file__).with_name("cpu_attention.c")
_lib: ctypes.CDLL | None | bool = None
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ENTRY = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
_PREFILL = {torch.float32: "prefill_attention_f32", torch.bfloat16: "prefill_attention_bf16"}


def available() -> bool:
    """Whether the kernel runs here (DUPLEX_CPU_ATTENTION=0 turns it off, for comparisons)."""
    return not switches.is_off("DUPLEX_CPU_ATTENTION") and _load() is not False


def fits(q: torch.Tensor, k_cache: torch.Tensor, soft_cap: float | None) -> bool:
    """Whether the kernel takes these inputs: fp32 q, an fp32 or bf16 cache (an int8 pool's
    packed rows take the torch path, kernels.attention), no soft cap, head_dim % 16 == 0."""
    heads, head_dim = q.shape[1:]
    return (soft_cap is None and q.dtype == torch.float32 and k_cache.dtype in _ENTRY
            and q.device.type == "cpu" and head_dim % 16 == 0 and q.stride(2) == 1
            and q.stride(1) == head_dim and k_cache.is_contiguous()
            and heads // k_cache.shape[2] <= 16)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           rows: torch.Tensor | None, keys: torch.Tensor, counts: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q `[T, H, D]`; rows `[B]` (None: rows 0..B-1); keys `[B, L]` int64 cache slots of
    which the first `counts[b]` are seen -> `[B, H, D]` fp32."""
    num_seqs, num_keys = keys.shape
    heads, head_dim = q.shape[1:]
    out = torch.empty(num_seqs, heads, head_dim, dtype=torch.float32)
    rc = getattr(_load(), _ENTRY[k_cache.dtype])(
        q.data_ptr(), 0 if rows is None else rows.data_ptr(), q.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), keys.data_ptr(), counts.data_ptr(),
        num_seqs, num_keys, heads, k_cache.shape[2], head_dim, scale, out.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"{_ENTRY[k_cache.dtype]} refused q {tuple(q.shape)}")
    return out


def prefill_available() -> bool:
    """Whether the prompt kernel runs here: AVX512, or AVX2 + FMA
    (DUPLEX_CPU_PREFILL_ATTENTION=0 turns it off, for comparisons; elsewhere torch's fused
    attention)."""
    lib = _load() if available() else False
    return bool(lib) and not switches.is_off("DUPLEX_CPU_PREFILL_ATTENTION") \
        and bool(lib.prefill_available())


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: torch.Tensor,
            scale: float, out: torch.Tensor) -> None:
    """One sequence's prompt rows: q `[Q, H, D]` (rows strided, heads contiguous) over the
    `L` keys whose cache slots are `keys [L]` (positions 0 .. L - 1), query i at position
    L - Q + i seeing the keys up to it; writes `out [Q, H, D]` (fp32, same layout)."""
    num_queries, heads, head_dim = q.shape
    rc = getattr(_load(), _PREFILL[k_cache.dtype])(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), keys.data_ptr(),
        keys.shape[0], num_queries, heads, k_cache.shape[2], head_dim, scale, out.data_ptr(),
        out.stride(0), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"{_PREFILL[k_cache.dtype]} refused q {tuple(q.shape)}")


def use_avx2_build() -> bool:
    """From now on in this process, the kernel as built for a CPU with AVX2 and without
    AVX512 (-mno-avx512f: the 8-lane walk most laptops run), in place of this CPU's own build,
    so that path can be tested and timed on an AVX512 machine. False (nothing changed) where
    this CPU has no AVX2 or the build fails."""
    global _lib
    if not {b"avx2", b"fma"} <= set(cpu_flags().split()):
        return False
    lib = load_library(_SOURCE, ["-fopenmp", "-mno-avx512f"], ("-lmvec",), _declare,
                       "AVX2 build of the CPU decode attention kernel")
    if lib:
        _lib = lib
    return bool(lib)


def _load():
    global _lib
    if _lib is None:
        _lib = load_library(_SOURCE, ["-fopenmp"], ("-lmvec",), _declare,
                            "CPU decode attention kernel")
    return _lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL | bool:
    lib.attn_available.restype = ctypes.c_int
    for name in _ENTRY.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P,
                       ctypes.c_int]
    lib.prefill_available.restype = ctypes.c_int
    for name in _PREFILL.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _I, ctypes.c_int]
    return lib if lib.attn_available() else False
