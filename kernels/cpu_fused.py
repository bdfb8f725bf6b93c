"""Fused fp32 CPU ops (kernels/cpu_fused.c), compiled once per machine and called by ctypes.

    rms_norm(x, weight, eps, residual)   one pass instead of ~12 torch ops
    rope_neox_(x, positions, cache)      in place, instead of gather + roll + 3 arithmetic ops
    silu_mul(gate_up)                    silu(gate) * up, one pass instead of 3 ops
    rope_store_kv(qkv, ...)              rotary of q and k, and the KV cache write, in one

RMSNorm and SiLU-and-mul also read bf16 inputs and write bf16 outputs (`out_dtype`), and
rope_store_kv reads a bf16 q/k/v matmul output: a step whose matmuls run in bf16 then needs
no conversion op between them (engine/models/llama.py), with bitwise the results of the fp32
kernels followed by torch's conversions.

A batch-1 decode step is set by per-op overhead (DESIGN.md §5), so these three chains,
repeated in every layer, are worth a kernel. The C source is built with the machine's own
compiler (`cc -O3 -march=native -ffp-contract=off`) into a cache directory keyed by the
source's digest; where no compiler is found, `available()` is False and callers keep the
torch references. Rotary is bitwise equal to `rotary_embedding_ref` (no contraction into
fused multiply-adds); RMSNorm and SiLU round differently from torch (reduction order, exp),
within a few fp32 ulps, so `ops` uses them only while `use_fused(True)` is set (the engine
sets it for quantized weights, never in the exact float32 mode).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("duplex.kernels")

_SOURCE = Path(__file__).with_name("cpu_fused.c")
_lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable
_enabled = False
_F, _I = ctypes.c_float, ctypes.c_int64
_P = ctypes.c_void_p


def available() -> bool:
    return _load() is not False


def is_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def use_fused(enabled: bool = True):
    """Turn the fused RMSNorm / SiLU on for the `with` block (rotary is exact: always on)."""
    global _enabled
    previous, _enabled = _enabled, enabled and available()
    try:
        yield
    finally:
        _enabled = previous


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """`rms_norm_ref` semantics (offset 0) for contiguous `[rows, n]`: x fp32 (or bf16 with
    out_dtype given), weight and residual fp32, out in out_dtype (default x's)."""
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype)
    new_residual = torch.empty_like(residual) if residual is not None else None
    residual_args = (0 if residual is None else residual.data_ptr(), weight.data_ptr())
    # fp32 in and out are the same entry with both bf16 flags off (rows over the threads)
    _check(_load().rms_norm_mixed(
        x.data_ptr(), _is_bf16(x), *residual_args, out.data_ptr(), _is_bf16(out),
        0 if new_residual is None else new_residual.data_ptr(), x.shape[0], x.shape[1], eps,
        torch.get_num_threads()))
    return out if residual is None else (out, new_residual)


def rope_neox_(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, heads, D]` (last two dims contiguous, any row stride) in place."""
    _load().rope_neox_f32_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2],
                               cache.data_ptr(), positions.data_ptr(), torch.get_num_threads())
    return x


def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`[rows, 2n]` contiguous fp32 (or bf16 with out_dtype given) -> `silu(gate) * up`,
    `[rows, n]`, computed in fp32 and written in out_dtype (default gate_up's)."""
    n = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], n, dtype=out_dtype or gate_up.dtype)
    _check(_load().silu_mul_mixed(gate_up.data_ptr(), _is_bf16(gate_up), out.data_ptr(),
                                  _is_bf16(out), gate_up.shape[0], n, torch.get_num_threads()))
    return out


def rope_store_kv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                  positions: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """A fused q/k/v projection's output `[T, (heads + 2 kv_heads) D]` (fp32 or bf16, rows
    contiguous, any row stride): returns q rotated, fp32 `[T, heads, D]`; k rotated and v
    are written into the caches' slots (slot < 0: skipped), rounded to bf16 for bf16 caches.
    Bitwise `rope_neox_` on the fp32 values, then `store_kv_ref`. Float caches only: an int8
    pool's packed rows are written by kernels.kv_store (ops.rope_and_store_kv routes there)."""
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16), (
        f"rope_store_kv writes fp32 or bf16 caches, not {k_cache.dtype}")
    q = torch.empty(qkv.shape[0], heads, head_dim)
    num_slots = k_cache.numel() // (kv_heads * head_dim)
    rc = _load().rope_store_kv(
        qkv.data_ptr(), _is_bf16(qkv), qkv.stride(0), qkv.shape[0], heads, kv_heads, head_dim,
        cache.data_ptr(), cache.shape[0], positions.data_ptr(), slots.data_ptr(), num_slots,
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _is_bf16(k_cache),
        torch.get_num_threads())
    if rc == -2:
        raise IndexError(f"rope_store_kv: a position past the rotary cache's {cache.shape[0]} "
                         f"rows or a slot past the cache's {num_slots}")
    _check(rc)
    return q


def fits(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops take these: fp32 on the CPU."""
    return all(t.dtype == torch.float32 and t.is_cpu for t in tensors)


def fits_mixed(*tensors: torch.Tensor) -> bool:
    """Whether the `out_dtype` forms take these as activations: fp32 or bf16 on the CPU."""
    return all(t.dtype in _ACTIVATIONS and t.is_cpu for t in tensors)


_ACTIVATIONS = (torch.float32, torch.bfloat16)


def _is_bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def _check(rc: int) -> None:
    if rc != 0:
        raise MemoryError("fused CPU kernel: out of memory for its scratch row")


# ------------------------------------------------------------------------ build and load
def _load():
    global _lib
    if _lib is None:
        _lib = load_library(_SOURCE, ["-fopenmp", "-ffp-contract=off"], ("-lmvec",), _declare,
                            "fused CPU kernels")
    return _lib


def load_library(source_path: Path, flags: list[str], libs: tuple[str, ...], declare,
                 what: str) -> ctypes.CDLL | bool:
    """`declare(CDLL)` of the built library (it returns the library, or False when the
    library says it cannot run here), or False when it cannot be built or loaded."""
    try:
        return declare(ctypes.CDLL(str(build_library(source_path, flags, libs))))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        log.warning("%s unavailable, using torch's: %s", what, e)
        return False


def build_library(source_path: Path, flags: list[str], libs: tuple[str, ...] = ()) -> Path:
    """Compile one C file into a shared library in the cache directory (once per source,
    flags and CPU) and return its path; raises RuntimeError / SubprocessError on failure."""
    source = _with_local_includes(source_path)
    # -march=native: a library built on one CPU may not run on another, so the CPU is keyed
    key = source + " ".join([*flags, *libs]).encode() + os.uname().machine.encode() + cpu_flags()
    digest = hashlib.sha256(key).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "duplex"
    target = cache / f"{source_path.stem}-{digest}.so"
    if target.is_file():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, "-O3", "-march=native", *flags, "-fPIC", "-shared",
                        "-o", str(built), str(source_path), *libs, "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(built, target)  # atomic: concurrent builders end with one good file
    return target


def _with_local_includes(path: Path, seen: set[Path] | None = None) -> bytes:
    """The file's bytes, then those of every `#include "..."` it reaches (once each), so a
    change to any of them builds the library again."""
    seen = set() if seen is None else seen
    seen.add(path)
    data = path.read_bytes()
    out = data
    for name in re.findall(rb'^#include "([^"]+)"', data, re.M):
        included = path.parent / name.decode()
        if included not in seen:
            out += _with_local_includes(included, seen)
    return out


def cpu_flags() -> bytes:
    """The CPU's /proc/cpuinfo flags line (empty when unreadable)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.rms_norm_f32.argtypes = [_P, _P, _P, _P, _P, _I, _I, _F]
    lib.rope_neox_f32.argtypes = [_P, _I, _I, _I, _I, _P, _P]
    lib.silu_mul_f32.argtypes = [_P, _P, _I, _I]
    _C = ctypes.c_int
    lib.rope_neox_f32_rows.argtypes = [_P, _I, _I, _I, _I, _P, _P, _C]
    for fn in (lib.rms_norm_f32, lib.rope_neox_f32, lib.silu_mul_f32, lib.rope_neox_f32_rows):
        fn.restype = None
    lib.rms_norm_mixed.argtypes = [_P, _C, _P, _P, _P, _C, _P, _I, _I, _F, _C]
    lib.silu_mul_mixed.argtypes = [_P, _C, _P, _C, _I, _I, _C]
    lib.rope_store_kv.argtypes = [_P, _C, _I, _I, _I, _I, _I, _P, _I, _P, _P, _I, _P, _P, _P,
                                  _C, _C]
    for fn in (lib.rms_norm_mixed, lib.silu_mul_mixed, lib.rope_store_kv):
        fn.restype = _C
    return lib
