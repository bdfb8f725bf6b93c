"""GGUF quantized blocks -> `kernels.quant.QuantWeight`, keeping the file's own integers.

Layouts (ggml's, as the `gguf` package reads them; one row of the tensor is a run of blocks):

    Q4_0  32 weights in 18 bytes:  d f16 | 16 bytes of nibbles        w = d * (q - 8)
    Q4_1  32 weights in 20 bytes:  d f16 | m f16 | 16 bytes           w = d * q + m
    Q4_K 256 weights in 144 bytes: d f16 | dmin f16 | 12 bytes of 6-bit (scale, min) pairs
          for 8 sub-blocks of 32 | 128 bytes of nibbles               w = d*sc * q - dmin*m
    Q8_0  32 weights in 34 bytes:  d f16 | 32 int8                   w = d * q

Nibbles: in a run of n bytes the low nibbles are the first n weights and the high nibbles
the next n (n = 16 for Q4_0 / Q4_1; 32 for each 64 weights of Q4_K).
All three 4-bit formats become int4 with group 32: scale = d (or d*sc) and
zero = the weight at q = 8 (the VNNI kernel's form). Q8_0 becomes (int8 values, per-32
scales) for the embedding; a Q8_0 linear layer, like every type in OWN_BITS_TYPES, keeps its
bytes (`gguf_weight`).
The tests hold every unpacking to `gguf.dequantize` on the same bytes.

`gguf_weight` keeps any type kernels.cpu_gguf reads (Q4_0 ... Q6_K, F16, BF16) as the
file's bytes in a `GGUFWeight`, plus the int4 form above where the VNNI kernel will run and
the file is small enough for its layout to pay (`vnni_layouts`).
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from duplex.kernels import cpu_gguf, cpu_qgemv, switches
from duplex.kernels.gguf_weight import GGUFWeight
from duplex.kernels.quant import QuantWeight

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# linear weights that run with their own bits (F32 is a plain tensor already)
OWN_BITS_TYPES = tuple(name for name in cpu_gguf.TYPE_IDS if name != "F32")

# Files up to this size get the VNNI kernel's layout beside their bytes (`vnni_layouts`).
VNNI_MAX_FILE_BYTES = 256 << 20

log = logging.getLogger("duplex.engine")
_said: set[tuple[str, str]] = set()  # the (news, GGUF type) pairs say_once has logged


def say_once(news: str, type_name: str, message: str, *args) -> None:
    """One log line per GGUF type and kind of news: its linear weights dequantized (no
    kernel here), its prompt steps on int8 activations."""
    if (news, type_name) not in _said:
        _said.add((news, type_name))
        log.info(message, type_name, *args)


def vnni_layouts(file_bytes: int) -> bool:
    """Whether a GGUF file's Q4 weights also get the VNNI kernel's layout (kernels.cpu_qgemv),
    ~0.9 bytes a weight beside the file's ~0.6 (the prompt GEMM and the other row kernels
    read the file's bytes). It pays where decode is bound by the dots rather than by the
    bytes: measured on the AMX VM (docs/BENCHMARKS.md), SmolLM2 (a 92 MB file) decodes in 5.5
    against 9.3 ms a token with it, for 0.21 GB; the 1B shape (636 MB) in 38.9 against 42.6
    ms, for 0.65 GB, which takes its RSS from 0.91x llama-server's to 1.26x. So files up to
    VNNI_MAX_FILE_BYTES get it; DUPLEX_GGUF_VNNI=1 or 0 decides for every file."""
    choice = switches.value("DUPLEX_GGUF_VNNI")
    if choice in ("0", "1"):
        return choice == "1"
    return file_bytes <= VNNI_MAX_FILE_BYTES


def quantized_linear(type_name: str, raw: np.ndarray, num_cols: int, permute, quant: str,
                     dtype: torch.dtype, vnni: bool = True) -> QuantWeight | None:
    """A GGUF linear weight as `quant` keeps it: `auto` runs OWN_BITS_TYPES with their own
    bits (no dense copy unless DUPLEX_DENSE_WEIGHTS=1; the VNNI layout too where `vnni`),
    `int4` keeps the 4-bit types' int4; None where the caller dequantizes it (for `auto`,
    said once per type)."""
    if quant == "auto" and type_name in OWN_BITS_TYPES:
        return gguf_weight(type_name, raw, num_cols, permute, vnni)
    if quant == "int4" and type_name in INT4_TYPES:
        return unpack_int4(type_name, raw, num_cols).map_rows(permute).to_weight()
    if quant == "auto" and type_name != "F32":
        say_once("dequantized", type_name, "GGUF %s weights have no kernel here: dequantized to %s",
                 dtype)
    return None


def gguf_weight(type_name: str, raw: np.ndarray, num_cols: int, permute,
                vnni: bool = True) -> GGUFWeight:
    """raw: uint8 `[N, bytes_per_row]` of a type in OWN_BITS_TYPES; `permute` reorders rows
    (any row order is the same bytes, row by row); `vnni`: the VNNI layout too, where its
    kernel runs."""
    rows = permute(np.ascontiguousarray(raw).view(np.uint8).reshape(raw.shape[0], -1))  # bytes
    int4 = None
    if vnni and type_name in INT4_TYPES and cpu_qgemv.available() \
            and cpu_qgemv.fits(len(rows), num_cols):
        int4 = tuple(torch.from_numpy(np.ascontiguousarray(a))
                     for a in unpack_int4(type_name, rows, num_cols))
    weight = GGUFWeight(cpu_gguf.TYPE_IDS[type_name], GGUFWeight.own_bytes(rows), num_cols, int4)
    if weight.int8_prompt():  # a prompt's numbers move further from fp32's: say so
        say_once("int8 prompts", type_name, "GGUF %s prompt steps take int8 activations here, "
                 "as decode steps do (DUPLEX_INT8_PROMPT=%s; 0: the bf16 or fp32 GEMM)",
                 switches.value("DUPLEX_INT8_PROMPT"))
    return weight


def unpack_int4(type_name: str, raw: np.ndarray, num_cols: int) -> Int4Rows:
    """raw: uint8 `[N, bytes_per_row]` of a Q4_0 / Q4_1 / Q4_K tensor with K = num_cols."""
    rows = raw.shape[0]
    if type_name == "Q4_K":
        q, scale, zero = _q4_k(raw.reshape(rows, -1, 144))
    else:
        q, scale, zero = _q4_0_1(raw.reshape(rows, -1, 18 if type_name == "Q4_0" else 20),
                                 has_min=type_name == "Q4_1")
    return Int4Rows(q.reshape(rows, num_cols), scale.reshape(rows, -1), zero.reshape(rows, -1))


class Int4Rows(NamedTuple):
    """Row-major int4 parameters; any row permutation applies to all three alike."""
    q: np.ndarray  # uint8 [N, K], values in [0, 16)
    scale: np.ndarray  # fp32 [N, K / 32]
    zero: np.ndarray  # fp32 [N, K / 32]

    def map_rows(self, fn) -> Int4Rows:
        return Int4Rows(fn(self.q), fn(self.scale), fn(self.zero))

    def to_weight(self, with_dense: bool = False) -> QuantWeight:
        return QuantWeight(4, *(torch.from_numpy(np.ascontiguousarray(a)) for a in self),
                           with_dense=with_dense)


def unpack_q8_0(raw: np.ndarray, num_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """raw: uint8 `[N, bytes_per_row]` -> (int8 `[N, K]`, fp32 scales `[N, K / 32]`)."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8)
    return torch.from_numpy(q.reshape(raw.shape[0], num_cols)), torch.from_numpy(d)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 `[..., n]` -> `[..., 2n]`: low nibbles, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _q4_0_1(blocks: np.ndarray, has_min: bool):
    """blocks `[N, B, 18 | 20]` -> q `[N, B, 32]`, scale and zero `[N, B]`."""
    d = _f16(blocks, 0)
    m = _f16(blocks, 2) if has_min else -8 * d
    q = _nibbles(blocks[..., 4 if has_min else 2:])
    return q, d, m + 8 * d


def _q4_k(blocks: np.ndarray):
    """blocks `[N, B, 144]` -> q `[N, B, 256]`, scale and zero `[N, B * 8]`."""
    from gguf.quants import Q4_K

    n, b = blocks.shape[:2]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(n * b, 12))
    scale = d.reshape(-1, 1) * sc.astype(np.float32)  # [N * B, 8]
    minimum = dmin.reshape(-1, 1) * mn.astype(np.float32)
    q = _nibbles(blocks[..., 16:].reshape(n, b, 4, 32)).reshape(n, b, 256)
    return q, scale.reshape(n, b * 8), (8 * scale - minimum).reshape(n, b * 8)
