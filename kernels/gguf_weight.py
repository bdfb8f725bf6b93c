"""A linear weight kept as a GGUF file's own blocks (Q4_0 ... Q6_K, F16, BF16, F32).

`GGUFWeight` stands where a `[N, K]` weight would, like `kernels.quant.QuantWeight` (of which
it is a kind, so `ops.linear` and the models treat both alike). It holds the file's bytes,
`raw [N, row_bytes]`, and nothing dense; a matmul of M rows runs, in this order of choice:

    path                   when                                   reads
    VNNI int4 (qgemv)      Q4_0/Q4_1/Q4_K, AVX512-VNNI, M <= 12/64  its int4 layout (built once,
                           files up to 256 MB: gguf_quant)        beside raw)
    row kernel (cpu_gguf)  M <= row_limit (16; K-quants 48, with   raw: a row at a time into L1
                           AMX-INT8 or AVX512-VNNI 96), not a     (K-quants from 8 rows on AMX:
                           prompt step (a head's rows: also in    16 rows a tile; from 8 rows on
                           one)                                   AVX512-VNNI: 16 weight rows in
                                                                  a register's lanes)
    AMX-BF16 GEMM          otherwise, CPUs with AMX-BF16 (not a   raw: 256 x 512 weights to bf16
                           head)                                  into L2 at a time (gemm_bf16)
    AVX512-BF16 GEMM       otherwise, CPUs with AVX512-BF16 (not  raw: 32 rows x K weights to
                           a head)                                bf16 into L2 at a time
                                                                  (gemm_bf16)
    int8 lanes (cpu_gguf)  prompt steps of K-quants on AVX512-    raw: 16 weight rows (VNNI)
                           VNNI without AMX, or on AVX2 without   or 8 rows of x (AVX2) in a
                           AVX-512 VNNI (DUPLEX_INT8_PROMPT:      register's lanes, every M
                           auto), before the two above
    bf16 GEMM              the two above switched off             raw: BF16_CHUNK weights to
                                                                  bf16 at a time, oneDNN's GEMM
    tiled GEMM             otherwise                              raw: TILE_BYTES of fp32 rows
                                                                  at a time, then torch's GEMM

Why tiles and not int8 activations (llama.cpp's way) for big M, where the CPU has no VNNI
kernel that beats them: a GEMM on a dequantized tile costs the dequantization once per call
(N * K, amortized over M rows) and runs at the GEMM's speed; its result is the fp32
reference's up to summation order and bf16 rounding, where int8 activations add theirs to
every prompt token. On AVX-512 VNNI without AMX, K-quant prompts take int8 activations by
default all the same: there `vpdpbusd` does twice the multiply-adds of `vdpbf16ps` a cycle,
and the measured cost is 14.094 -> 14.120 perplexity (`int8_prompt`). On AVX2 without AVX-512
VNNI they do too: the kernel with rows of x in the lanes sums in int16 between the scale
multiplies, 1.4-1.5x the fp32 tiles' prompt speed on a Zen 1 (docs/BENCHMARKS.md, "Eighteenth
session"). The dense bf16 copy the engine
used to keep for this (2 bytes a weight beside the ~0.6 of the file) is opt-in:
DUPLEX_DENSE_WEIGHTS=1 keeps one per weight and logs what it costs.

A GGUF token embedding is a `GGUFWeight` too (`lookup(ids)` dequantizes only the rows asked
for), and a tied output head is the same object: the table's bytes are held once.

Inside `quant.prompt_step()` every M takes one path (the int8 lanes, the bf16 GEMM or the
tiled path), so a prompt's numbers do not depend on how much of it came from the prefix cache.
"""
from __future__ import annotations

import functools
import logging
import threading

import torch

from duplex.kernels import cpu_gguf, cpu_qgemv, memory, quant, switches
from duplex.kernels.cpu_fused import cpu_flags
from duplex.kernels.quant import QuantWeight

log = logging.getLogger("duplex.kernels")

# The row kernel's limit, from where the tiled GEMM is faster (measured on an AVX2 EPYC, 2
# threads, docs/BENCHMARKS.md): 32-weight blocks (Q4_0 .. Q8_0) are cheap to unpack and their
# rows cost the same per x row, so tiles win past ~20 rows; a K-quant block is unpacked once
# for up to 4 x rows, so its rows win up to ~64 (Q4_K 2048x2048 at 16 rows: 1.6x the tiles).
GEMV_ROWS = 16
K_QUANT_ROW_FACTOR = 3  # K-quants: GEMV_ROWS * this
# K-quants on AMX-INT8 tiles (cpu_gguf.c, from cpu_gguf.AMX_ROWS rows): they beat the bf16 GEMM
# up to ~100 rows at the 1B shape (ffn_down 96 rows: 5.2 against 6.0 ms; 128: 6.8 against 5.5).
# The same limit for the AVX-512 VNNI kernel with weight rows in the lanes (from
# cpu_gguf.VN_ROWS rows, no AMX): on an AMD Zen 4 it beats the bf16 chunks at every row count
# (a 3B-shape layer at 96 rows: 50 against 101 ms; docs/BENCHMARKS.md); a decode step of more
# rows is rare; prompt steps take the lanes kernel at every row count (GGUFWeight.int8_prompt)
AMX_ROW_LIMIT = 96
TILE_BYTES = 1 << 22  # fp32 rows dequantized at a time: half an L3 (measured, docs/BENCHMARKS.md)
MIN_ROWS = 16  # the tiled GEMM's fewest rows (padded): from here torch's sums agree bitwise
# ... and above it rows are padded to a multiple of this: torch's fp32 GEMM takes a slower
# path for a ragged count (1B-shape layer on an AVX2 Zen 1, in turns: 94 rows 193.9 -> 179.3
# ms, 30 rows 95.2 -> 76.5 ms padded to 96 and 32; the same bits; a multiple of 16 was slower)
ROW_MULTIPLE = 8
BF16_CHUNK = 1 << 24  # weights dequantized at a time for the bf16 GEMM (32 MB): a 1B FFN weight
# rows of x per bf16 GEMM call, always (padded; GGUFWeight._bf16_chunks): 128 for weights of up
# to 4 M values, 64 above (measured best at SmolLM2's and the 1B shape's, docs/BENCHMARKS.md)
BF16_ROWS_SMALL, BF16_ROWS, BF16_SMALL_WEIGHT = 128, 64, 1 << 22
_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5,
         "Q5_K": 5}
_dense_bytes = 0  # what the opt-in dense copies hold, all weights together (logged)


def dense_by_default() -> bool:
    """DUPLEX_DENSE_WEIGHTS=1: every GGUF weight also keeps a bf16 copy for big batches."""
    return switches.value("DUPLEX_DENSE_WEIGHTS") == "1"


class GGUFWeight(QuantWeight):
    """`raw` uint8 `[N, row_bytes]`: N rows of ggml type `type_id` with K weights each.
    `int4` (q, scale, zero) as `QuantWeight` takes them: given for Q4 types where the VNNI
    kernel runs, turned into its layout by `pack()` and dropped."""

    # True for an output head: its rows never go through a bf16 GEMM (the bf16 chunks or
    # the dense copy), whose bf16 output would round the logits to 1/8 at |logit| 16-32 and
    # decide greedy near-ties by rounding (it turned SmolLM2's "The capital of France is
    # Paris." into "L'Étoile, ..."); they take the row kernel or the fp32 tiles.
    fp32_out = False

    def __init__(self, type_id: int, raw: torch.Tensor, k: int,
                 int4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 with_dense: bool | None = None) -> None:
        assert raw.shape[1] == cpu_gguf.row_bytes(type_id, k), (
            f"{cpu_gguf.TYPES[type_id][0]} [N, {k}] has {cpu_gguf.row_bytes(type_id, k)} "
            f"bytes a row, got {raw.shape[1]}")
        self.type_id, self.raw, self.int4 = type_id, raw.contiguous(), int4
        self.type_name = cpu_gguf.TYPES[type_id][0]
        self.bits = _BITS.get(self.type_name, 4)
        self.group_size = cpu_gguf.TYPES[type_id][1]
        self.with_dense = dense_by_default() if with_dense is None else with_dense
        self.shape = torch.Size((raw.shape[0], k))
        self.dense: torch.Tensor | None = None
        self.q = self.scale = self.zero = None
        self._packed: bool | None = None  # True once pack() ran
        self._vnni: cpu_qgemv.Packed | None = None
        self._vnni_pointers = None
        self._dtype = torch.float32
        self.dtype = torch.float32  # what lookup() returns (the model's dtype when an embedding)

    # ------------------------------------------------------------------ construction
    def can_cat(self, weights: list) -> bool:
        return all(type(w) is GGUFWeight and w.type_id == self.type_id
                   and w.shape[1] == self.shape[1] and (w.int4 is None) == (self.int4 is None)
                   and w.with_dense == self.with_dense for w in weights)

    @staticmethod
    def cat(weights: list[GGUFWeight]) -> GGUFWeight:
        """Stack along N (fused projections) before packing: the rows' bytes, one after
        another, are the fused weight's."""
        first = weights[0]
        assert first.can_cat(weights) and first._packed is None, "mixed types or packed"
        int4 = None if first.int4 is None else tuple(
            torch.cat([w.int4[i] for w in weights]) for i in range(3))
        raws = [w.raw for w in weights]
        raw = memory.empty((sum(r.shape[0] for r in raws), raws[0].shape[1]), torch.uint8)
        return GGUFWeight(first.type_id, torch.cat(raws, out=raw), first.shape[1], int4,
                          first.with_dense)

    @staticmethod
    def own_bytes(rows) -> torch.Tensor:
        """A copy of rows (uint8 `[N, row_bytes]`, numpy or torch) on 2 MB pages where the
        system gives them (kernels.memory): a decode step streams every weight once, and on
        4 KB pages one token's linears at the 3B shape read 18-20 against 22 GB/s (an AMD
        Zen 4, docs/BENCHMARKS.md)."""
        out = memory.empty(tuple(rows.shape), torch.uint8)
        if isinstance(rows, torch.Tensor):
            return out.copy_(rows)
        out.numpy()[...] = rows  # numpy's copy: a read-only file mapping needs no torch view
        return out

    def pack(self, dtype: torch.dtype = torch.bfloat16) -> GGUFWeight:
        """The VNNI layout where it runs (Q4 types), the opt-in dense copy; `raw` stays."""
        global _dense_bytes
        if self.int4 is not None and cpu_qgemv.available() and cpu_qgemv.fits(*self.shape):
            self._vnni = cpu_qgemv.pack_int4(*self.int4)
            self._vnni_pointers = self._vnni.pointers
        self.int4 = None
        if self.with_dense:
            dense = memory.empty(self.shape, torch.bfloat16)
            dense.copy_(self.dequantize(torch.bfloat16))
            self.dense = quant.prepack_dense(dense)
            _dense_bytes += dense.numel() * 2
            log.info("DUPLEX_DENSE_WEIGHTS=1: bf16 copies hold %.1f MB so far",
                     _dense_bytes / 1e6)
        self._packed = True
        return self

    # ------------------------------------------------------------------ use
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return cpu_gguf.dequant(self.type_id, self.raw, self.shape[1]).to(dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows: ids `[T]` -> `[T, K]` in self.dtype, from those rows' bytes only."""
        rows = self.raw.index_select(0, ids.reshape(-1).to(torch.long))
        return cpu_gguf.dequant(self.type_id, rows, self.shape[1]).to(self.dtype)

    def vnni_layout(self) -> cpu_qgemv.Packed | None:
        if self._packed is None:
            self.pack()
        return self._vnni

    def dense_from_rows(self) -> int | None:
        """The fewest rows whose output comes from a bf16 GEMM (always inside a prompt step):
        the dense copy's, or the bf16 chunks' where they are the prompt GEMM; None where such
        rows take fp32 tiles. The models then pass those rows between kernels in bf16
        (engine.models.llama.stream_rows)."""
        if self._packed is None:
            self.pack()
        if self.fp32_out or (self.dense is None and self.int8_prompt()):
            return None
        if self.dense is not None:
            return (self.row_limit() if self._vnni is None else quant.MAX_VNNI_ROWS) + 1
        if prompt_gemm_dtype() == torch.bfloat16:
            return max(self.row_limit(), 0 if self._vnni is None else quant.MAX_VNNI_ROWS) + 1
        return None

    def row_limit(self) -> int:
        """The most rows a decode step runs through the row kernel (GEMV_ROWS)."""
        return row_limit(self.type_id)

    @property
    def nbytes(self) -> int:
        tensors = [self.raw, self.dense] + ([] if self.int4 is None else list(self.int4))
        own = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return own + (0 if self._vnni is None else self._vnni.nbytes)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`x [..., K] @ w.T + bias -> [..., N]`, in out_dtype (default x's dtype)."""
        if self._packed is None:
            self.pack()
        assert x.shape[-1] == self.shape[1], f"x [..., {self.shape[1]}] expected, got {tuple(x.shape)}"
        rows = x.reshape(-1, self.shape[1])
        out = self._rows_linear(rows)
        if bias is not None:
            out = out.to(x.dtype) + bias
        out = out.to(out_dtype or x.dtype)
        return out.reshape(*x.shape[:-1], self.shape[0])

    def _rows_linear(self, rows: torch.Tensor) -> torch.Tensor:
        """rows `[M, K]` -> `[M, N]` (fp32, or bf16 from a bf16 GEMM)."""
        m, prompt = rows.shape[0], quant.in_prompt_step()
        if self.dense is not None and not self.fp32_out and (prompt or m >= self.dense_from_rows()):
            return quant.dense_linear(rows.to(torch.bfloat16), self.dense)
        # a head's rows are sampled positions, one a request, never a prompt's rows: the
        # few-row kernels take them in prompt steps too (18 against 0.8 ms at SmolLM2's)
        few = not prompt or self.fp32_out
        if few and self._vnni is not None and m <= quant.MAX_VNNI_ROWS:
            return cpu_qgemv.linear(self._vnni, _fp32(rows), self._vnni_pointers)
        if (few and m <= self.row_limit()) or (prompt and self.int8_prompt()):
            # a head's rows in a prompt step (a prompt's first token): x in two int8 parts,
            # logits ~2.5e-5 of the largest from fp32 dots (one part: ~7e-3, which moved the
            # README's answer on a Zen 4), at ~1/4 the time of dequantizing each row to fp32
            # (docs/BENCHMARKS.md)
            head = prompt and self.fp32_out and m <= self.row_limit()
            return cpu_gguf.linear(self.type_id, self.raw, self.shape[1], _fp32(rows), split_x=head,
                                   lanes=prompt and not head and self._lanes_prompt())
        return self._tiled(rows)  # bf16 rows (the bf16 stream) stay bf16 for the bf16 GEMM

    def int8_prompt(self) -> bool:
        """Whether prompt steps take int8 activations, at any row count (so a prompt's
        numbers, row by row, never depend on how much of it was a cache hit).
        DUPLEX_INT8_PROMPT=auto (the default): K-quants on AVX-512 VNNI without AMX
        (`_lanes_prompt`), as llama.cpp's prompts and every decode step take them: 1.35x the
        AVX512-BF16 GEMM at 512 rows on a Zen 4, 1.16x the output tokens/s at concurrency 16
        at the 1B shape, for 14.094 -> 14.120 perplexity on SmolLM2's Q4_K_M requantization
        (docs/BENCHMARKS.md). =1: block types on a CPU without AVX512-VNNI too (a prompt tile
        costs its whole dequantization there however few rows it has: 1.2 s a step at the 1B
        shape), where they change SmolLM2's Q4_1 answer to "What is the capital of France?"
        (as llama.cpp's do on the same file). =0: the bf16 or fp32 tiles everywhere, a
        prompt's numbers the fp32 reference's up to their rounding. With AMX, auto keeps the
        AMX-BF16 prompt tiles (int8 prompts on AMX tiles are not measured yet)."""
        mode = switches.value("DUPLEX_INT8_PROMPT")
        if self.group_size < 32 or not cpu_gguf.available() or mode == "0":
            return False
        return self._lanes_prompt() or (mode == "1" and not cpu_qgemv.available())

    def _lanes_prompt(self) -> bool:
        """K-quants on AVX-512 VNNI without AMX, or on AVX2 without AVX-512 VNNI: int8 prompts
        take the kernel with weight rows (VNNI) or rows of x (AVX2) in the lanes at every row
        count (cpu_gguf.linear(lanes=True)), whose rows' bits do not depend on how many there
        are."""
        return self.group_size == 256 and cpu_gguf.lanes_available() and not cpu_gguf.amx_available()

    def _tiled(self, rows: torch.Tensor) -> torch.Tensor:
        """rows `[M, K]` fp32 -> `[M, N]`, on the dequantized weight in the prompt GEMM's
        dtype (`prompt_gemm_dtype`). Fewer than MIN_ROWS rows are padded with zeros: torch
        takes another kernel for a few rows, whose sums differ in the last bits, and a
        prompt's numbers must not depend on how many of its tokens came from the prefix cache
        (int8 activations after it would magnify them). More are padded to a multiple of
        ROW_MULTIPLE, where torch's GEMM is faster (the same bits)."""
        if prompt_gemm_dtype() == torch.bfloat16 and not self.fp32_out:
            return self._bf16_chunks(rows.to(torch.bfloat16))
        rows = _fp32(rows)
        m = rows.shape[0]
        padded = max(MIN_ROWS, -(-m // ROW_MULTIPLE) * ROW_MULTIPLE)
        if padded != m:
            return self._tiled(torch.cat([rows, rows.new_zeros(padded - m, rows.shape[1])]))[:m]
        n, k = self.shape
        step = max(16, TILE_BYTES // (4 * k))
        if step >= n:
            return rows @ self.dequantize().T
        out_t = torch.empty(n, rows.shape[0], dtype=torch.float32)  # [N, M]: tiles are rows
        tile = torch.empty(step, k, dtype=torch.float32)
        for n0 in range(0, n, step):
            part = tile[:min(step, n - n0)]
            cpu_gguf.dequant(self.type_id, self.raw[n0:n0 + step], k, part)
            torch.mm(part, rows.T, out=out_t[n0:n0 + part.shape[0]])
        return out_t.T.contiguous()  # callers view slices of the output

    def _bf16_chunks(self, rows: torch.Tensor) -> torch.Tensor:
        """rows `[M, K]` bf16 -> `[M, N]` bf16. With AMX-BF16 or AVX512-BF16, one C call on
        the blocks (cpu_gguf.gemm_bf16: each row's bits independent of M by construction; at
        the 1B shape 1.2x oneDNN's chunks at 512 rows, 2.9x at 16, docs/BENCHMARKS.md). Else
        (DUPLEX_GGUF_AMX=0 and DUPLEX_GGUF_BF16_GEMM=0) up to BF16_CHUNK weights at a time
        are dequantized straight to bf16 into one reused buffer (this thread's) and
        multiplied by oneDNN's bf16 GEMM as `chunk @ block.T`, the weight in the GEMM's
        row-major A place, where it is read as it is: in the other place oneDNN
        repacks it on every call. The rows go in blocks of exactly BF16_ROWS (the last one
        zero-padded; the count depends only on the weight's size): oneDNN picks its kernel by
        the shapes, and its sums for a row change with M (measured: 33 rows against 300 differ
        in the last bits), so a fixed M is what keeps a prompt's numbers the same whether its
        tokens come alone after a prefix-cache hit or inside a long prompt."""
        n, k = self.shape
        tiles = cpu_gguf.gemm_bf16(self.type_id, self.raw, k,
                                   rows if rows.stride(1) == 1 else rows.contiguous())
        if tiles is not None:  # the blocks dequantized in cache, any M
            return tiles
        m, size = rows.shape[0], BF16_ROWS_SMALL if n * k <= BF16_SMALL_WEIGHT else BF16_ROWS
        blocks = -(-m // size)
        if blocks * size != m:
            rows = torch.cat([rows, rows.new_zeros(blocks * size - m, k)])
        step = min(n, max(16, BF16_CHUNK // k))
        scratch = _scratch(step * k)
        out = torch.empty(blocks, n, size, dtype=torch.bfloat16)  # [block, N, row]
        for n0 in range(0, n, step):
            part = scratch[:min(step, n - n0) * k].view(-1, k)
            cpu_gguf.dequant(self.type_id, self.raw[n0:n0 + step], k, part)
            for b in range(blocks):
                torch.mm(part, rows[b * size:(b + 1) * size].T, out=out[b, n0:n0 + part.shape[0]])
        return cpu_gguf.unblock_bf16(out, m)  # [block, N, row] -> [M, N]


_local = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """This thread's bf16 buffer of at least numel elements (grown, never shrunk: its size is
    the largest chunk, BF16_CHUNK weights at most)."""
    buf = getattr(_local, "bf16", None)
    if buf is None or buf.numel() < numel:
        buf = _local.bf16 = torch.empty(numel, dtype=torch.bfloat16)
    return buf


def prompt_gemm_dtype() -> torch.dtype:
    """The dtype of the GEMM of GGUF prompt steps: bf16 where the CPU multiplies bf16 in
    hardware (AMX-BF16 or AVX512-BF16), where it runs 3-10x faster than fp32 at prompt row
    counts (docs/BENCHMARKS.md) and activations are rounded to bf16 as the bf16 KV cache
    beside quantized weights already rounds them; fp32 elsewhere (AVX2 CPUs, where torch's
    bf16 GEMM is slower than its fp32 one). DUPLEX_PROMPT_GEMM=fp32|bf16 sets it."""
    choice = switches.value("DUPLEX_PROMPT_GEMM")
    if choice:
        if choice not in ("fp32", "bf16"):
            raise ValueError(f"DUPLEX_PROMPT_GEMM must be fp32 or bf16, got {choice!r}")
        return torch.bfloat16 if choice == "bf16" else torch.float32
    return _hardware_bf16()


@functools.cache
def _hardware_bf16() -> torch.dtype:
    flags = cpu_flags()
    return torch.bfloat16 if b" amx_bf16" in flags or b" avx512_bf16" in flags \
        else torch.float32


def _fp32(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.float()
    return rows if rows.stride(1) == 1 else rows.contiguous()


def row_limit(type_id: int) -> int:
    """The most rows of a decode step the row kernel takes for this block type."""
    if cpu_gguf.TYPES[type_id][1] != 256:
        return GEMV_ROWS
    if cpu_gguf.amx_available() or cpu_gguf.lanes_available():
        return AMX_ROW_LIMIT
    return GEMV_ROWS * K_QUANT_ROW_FACTOR
