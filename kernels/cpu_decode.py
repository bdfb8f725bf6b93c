"""A Llama decode step's layers in one C call (kernels/cpu_decode.c).

    stack = DecodeStack(layers, dims, final_norm, rope_cache, max_rows)   once, from the weights
    h = stack.forward(h, kv_caches, positions, slots, block_tables, seq_lens, block_size)

The per-op path runs ~12 kernels a layer from Python; at batch 1 on a small model their
dispatch costs more than their arithmetic (docs/BENCHMARKS.md). `decode_forward` runs the
same kernels (kernels/cpu_fused.c, cpu_qgemv.c, cpu_attention.c, cpu_gguf.c, included into
one library) in the same order, so its output is bitwise that of the per-op path with the
fused kernels on, for the steps it takes: every row a one-token decode, quantized weights
without biases (in the VNNI layout, or a GGUF file's own rows: AVX2 is enough), fp32 or bf16
caches, full attention. A projection may be up to three parts of different kinds (a Q4_K_M
file's Q4_K q and k beside its Q6_K v), each run by its own kernel into its columns. The
model decides when it applies (engine/models/llama.py); `DUPLEX_FUSED_DECODE=0` turns it
off, for comparisons.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from duplex.kernels import cpu_gguf, switches
from duplex.kernels.cpu_fused import load_library
from duplex.kernels.cpu_qgemv import Packed

_SOURCE = Path(__file__).with_name("cpu_decode.c")
_lib: ctypes.CDLL | None | bool = None
_I, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
CACHE_DTYPES = (torch.float32, torch.bfloat16)
GGUF_KIND = 1000  # DEC_GGUF: kind = this + the ggml type id
MAX_PARTS = 3  # DEC_PARTS


class _Weight(ctypes.Structure):
    _fields_ = [("kind", _I), ("w", _P), ("scale", _P), ("zero", _P), ("n", _I), ("k", _I)]


class _Proj(ctypes.Structure):
    _fields_ = [("parts", _I), ("part", _Weight * MAX_PARTS)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Proj), ("o", _Proj),
                ("gate_up", _Proj), ("down", _Proj)]


@dataclass(frozen=True)
class GGUFRows:
    """A GGUF file's own rows, as kernels.cpu_gguf runs them: uint8 `raw [n, row_bytes]` of
    ggml type `type_id`, k weights a row."""
    type_id: int
    raw: torch.Tensor
    k: int

    @property
    def n(self) -> int:
        return self.raw.shape[0]


Part = Packed | GGUFRows


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I),
                ("head_dim", _I), ("intermediate", _I), ("eps", _F), ("scale", _F),
                ("final_norm", _P), ("rope_cache", _P)]


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # fp32 [hidden]
    post_norm: torch.Tensor
    # each projection: its parts stacked along N (1..MAX_PARTS)
    qkv: tuple[Part, ...]  # [heads * D + 2 * kv_heads * D, hidden]
    o: tuple[Part, ...]  # [hidden, heads * D]
    gate_up: tuple[Part, ...]  # [2 * intermediate, hidden]
    down: tuple[Part, ...]  # [hidden, intermediate]


def available() -> bool:
    return not switches.is_off("DUPLEX_FUSED_DECODE") and _load() is not False


class DecodeStack:
    """The weights' addresses as `decode_forward` takes them (the tensors never move; the
    stack keeps references so they cannot be freed under it)."""

    def __init__(self, layers: list[LayerWeights], dims: Dims, final_norm: torch.Tensor,
                 rope_cache: torch.Tensor, max_rows: int) -> None:
        for t in (final_norm, rope_cache, *(w for ly in layers for w in (ly.input_norm, ly.post_norm))):
            assert t.dtype == torch.float32 and t.is_contiguous(), "norms and rope: fp32 contiguous"
        assert rope_cache.shape[-1] == dims.head_dim, "rotary over the full head only"
        self._keep = (layers, final_norm, rope_cache)
        self.dims = dims
        self.max_rows = max_rows  # the most rows a step may have (its weights' row kernels)
        self._model = _Model(len(layers), dims.hidden, dims.heads, dims.kv_heads, dims.head_dim,
                             dims.intermediate, dims.eps, dims.head_dim ** -0.5,
                             final_norm.data_ptr(), rope_cache.data_ptr())
        self._layers = (_Layer * len(layers))(*(_layer(ly) for ly in layers))
        self._caches: tuple[int, object, ctypes.Array] | None = None

    def forward(self, h: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
        """h `[m, hidden]` fp32 embeddings (one decode token per sequence), overwritten with
        the final normed hidden states and returned; the step's k and v go to the caches."""
        assert h.is_contiguous() and h.shape[1] == self.dims.hidden
        rc = _load().decode_forward(
            ctypes.byref(self._model), self._layers, *self._cache_pointers(kv_caches),
            h.data_ptr(), h.shape[0], positions.data_ptr(), slots.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), block_size,
            torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"decode_forward refused a step of {h.shape[0]} rows")
        return h

    def _cache_pointers(self, kv_caches) -> tuple[ctypes.Array, int]:
        """(the caches' addresses, whether they are bf16), built once per cache list."""
        if self._caches is None or self._caches[0] != id(kv_caches):
            dtype = kv_caches[0][0].dtype
            for k, v in kv_caches:
                assert k.dtype == v.dtype == dtype in CACHE_DTYPES and k.is_contiguous() \
                    and v.is_contiguous()
            pointers = (_P * (2 * len(kv_caches)))(*(t.data_ptr() for kv in kv_caches for t in kv))
            self._caches = (id(kv_caches), kv_caches, (pointers, int(dtype == torch.bfloat16)))
        return self._caches[2]


def step_fits(h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> bool:
    """The dtypes and layouts `forward` reads (the caller checks that every row decodes).
    The C step writes and reads fp32 or bf16 caches only: an int8 pool (packed rows,
    kernels.kv_store) is not for it, and its steps take the per-op path."""
    return (h.dtype == torch.float32
            and (not kv_caches or kv_caches[0][0].dtype in CACHE_DTYPES)
            and positions.dtype == slots.dtype == torch.int64
            and block_tables.dtype == seq_lens.dtype == torch.int32
            and block_tables.stride(1) == 1 and positions.is_contiguous()
            and slots.is_contiguous() and seq_lens.is_contiguous())


def _weight(p: Part) -> _Weight:
    if isinstance(p, GGUFRows):
        assert p.raw.is_contiguous() and p.raw.dtype == torch.uint8
        return _Weight(GGUF_KIND + p.type_id, p.raw.data_ptr(), 0, 0, p.n, p.k)
    kind, w, scale, zero = p.pointers
    return _Weight(kind, w, scale, zero, p.n, p.k)


def _proj(parts: tuple[Part, ...]) -> _Proj:
    assert 1 <= len(parts) <= MAX_PARTS and len({p.k for p in parts}) == 1
    return _Proj(len(parts), (_Weight * MAX_PARTS)(*(_weight(p) for p in parts)))


def _layer(ly: LayerWeights) -> _Layer:
    return _Layer(ly.input_norm.data_ptr(), ly.post_norm.data_ptr(), _proj(ly.qkv),
                  _proj(ly.o), _proj(ly.gate_up), _proj(ly.down))


def _load():
    global _lib
    if _lib is None:
        _lib = load_library(_SOURCE, ["-fopenmp", "-ffp-contract=off"], ("-lmvec",), _declare,
                            "fused CPU decode step")
    return _lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL | bool:
    """The library where its attention runs (AVX2 + FMA, or AVX512); the VNNI parts are
    only ever given where cpu_qgemv runs (weights have that layout only there)."""
    if not lib.attn_available():
        return False
    lib.decode_forward.restype = ctypes.c_int
    lib.decode_forward.argtypes = [_P, _P, _P, ctypes.c_int, _P, _I, _P, _P, _P, _I, _P, _I,
                                   ctypes.c_int]
    cpu_gguf.apply_amx_switch(lib)  # its GGUF rows are cpu_gguf.c's, built in
    return lib
