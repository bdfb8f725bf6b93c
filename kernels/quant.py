"""Weight-only quantized linear layers: int4 with group-wise scales and zeros, int8 per channel.

A `QuantWeight` stands where a `[N, K]` weight tensor would (it has `.shape`), holds its
integers and scales, and knows how to multiply: `ops.linear(x, w)` dispatches to it.

    int4  w[n, k] = (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G]     q in [0, 16)
    int8  w[n, k] = q[n, k] * scale[n]                                       q in [-128, 128)

GGUF's Q4_0 (`d * (q - 8)`), Q4_1 (`d * q + m`) and Q4_K (`d * sc * q - dmin * m` per
32-element sub-block) are exactly int4 with G = 32 (zero = m + 8 d, or 8 d sc - dmin m): a
GGUF file's weights are `kernels.gguf_weight.GGUFWeight`s (this class's kind), which keep the
file's bytes for every common type and build this int4 form only for the VNNI kernel. Fused
projections whose parts differ in kind are `FusedWeight`s (`fuse`). Activations stay in their dtype (fp32 by default); the
CPU kernels are torch's `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm`, which
dequantize a tile at a time inside the GEMM. The references (`dequantize()` then a plain
matmul) are what the tests hold the kernels to.

Torch's weight-only kernels dequantize per output row, so their cost grows with the number
of rows M: at M = 1 (batch-1 decode, where the bytes read per step set the speed) they beat
every dense GEMM, from M ~ 8 on a bf16 GEMM (AMX / avx512_bf16) is several times faster
(figures in docs/BENCHMARKS.md). A weight made `with_dense=True` therefore also keeps a bf16
copy and runs batches of more than `MAX_PACKED_ROWS` rows through it (the loader asks for one
only for a GGUF file's tied output head; GGUFWeights tile instead, see kernels.gguf_weight). That copy is held in
oneDNN's own blocked layout where torch has oneDNN (`dense_linear`): `F.linear` on a plain
bf16 weight repacks it on every call, the prepacked one does not (measured 1.3-1.8x faster
at the SmolLM2 shapes, 16-256 rows; `DUPLEX_ONEDNN_PACK=0` keeps the plain copy, for
comparisons). It is the same bf16 GEMM with fp32 sums, but oneDNN may block the sum another
way for some shapes (the 576 x 576 projection at 1,000 rows), so results can differ from the
plain copy's in the last bits; every path of one engine uses the same copy.

The integers are kept unpacked until `pack()`, so models can fuse projections (`cat`) first;
packing is per output row block, so it cannot be concatenated afterwards.
"""
from __future__ import annotations

import contextlib

import torch

from duplex.kernels import cpu_qgemv, memory, switches
from duplex.kernels.cpu_fused import cpu_flags

INT4_GROUP = 32  # GGUF's block size; also what the int4 CPU kernel supports (32..256)
_INNER_K_TILES = 2
MAX_PACKED_ROWS = 4  # torch's kernels: above this many rows, a dense copy is faster (measured)


def vnni_rows() -> int:
    """The most rows the int4 VNNI kernel (kernels.cpu_qgemv) takes before a bf16 GEMM does,
    as measured (docs/BENCHMARKS.md). With AMX (the Intel VM) oneDNN's GEMM on a bf16 dense
    copy wins from ~16 rows, so 12 where GGUF weights keep one (DUPLEX_DENSE_WEIGHTS=1). Without
    copies (the default) the alternative is the GEMM on weights dequantized per call, which
    the VNNI kernel beats through 96 rows at SmolLM2's shapes even on AMX tiles (576 x 1536
    at 64 rows: 0.25 against 0.39 ms; a concurrency-16 decode step 27 against 74 ms on the
    row kernels), so 64, as on CPUs without AMX (AMD Zen 5: 0.57x the bf16 step at 16 rows,
    0.92x at 64). DUPLEX_VNNI_ROWS sets it, for comparisons."""
    if switches.value("DUPLEX_VNNI_ROWS"):
        return int(switches.value("DUPLEX_VNNI_ROWS"))
    dense = switches.value("DUPLEX_DENSE_WEIGHTS") == "1"
    return 12 if dense and b" amx_bf16" in cpu_flags() else 64


MAX_VNNI_ROWS = vnni_rows()
_prompt_step = False


def in_prompt_step() -> bool:
    return _prompt_step


@contextlib.contextmanager
def prompt_step(enabled: bool = True):
    """Inside, weights with a dense copy use it whatever the number of rows: a step that
    computes prompt tokens runs them the way a long prefill does, so a prompt's numbers (and
    a greedy answer) do not depend on how much of it came from the prefix cache."""
    global _prompt_step
    previous, _prompt_step = _prompt_step, enabled
    try:
        yield
    finally:
        _prompt_step = previous


class QuantWeight:
    """A quantized `[N, K]` linear weight. `bits` is 4 (group-wise) or 8 (per channel)."""

    def __init__(self, bits: int, q: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor | None = None, group_size: int = INT4_GROUP,
                 with_dense: bool = False) -> None:
        assert bits in (4, 8), f"bits must be 4 or 8, got {bits}"
        assert q.dim() == 2, f"q must be [N, K], got {tuple(q.shape)}"
        if bits == 4:
            assert q.shape[1] % group_size == 0 and zero is not None, (
                f"int4 needs K ({q.shape[1]}) divisible by the group ({group_size}) and zeros")
            assert scale.shape == zero.shape == (q.shape[0], q.shape[1] // group_size), (
                f"scale/zero must be [N, K / G], got {tuple(scale.shape)}")
        else:
            assert scale.shape == (q.shape[0],), f"int8 scale must be [N], got {tuple(scale.shape)}"
        self.bits, self.group_size, self.with_dense = bits, group_size, with_dense
        self.q, self.scale, self.zero = q, scale, zero
        self.dense: torch.Tensor | None = None  # bf16 [N, K] once packed, if with_dense
        self.shape = torch.Size(q.shape)
        self._packed: torch.Tensor | None = None
        self._vnni: cpu_qgemv.Packed | None = None  # the VNNI kernel's layout, where it runs
        self._vnni_pointers: tuple[int, int, int, int] | None = None
        self._qparams: torch.Tensor | None = None  # int4: [K / G, N, 2] (scale, zero)
        self._dtype: torch.dtype | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def int4_from_float(cls, w: torch.Tensor, group_size: int = INT4_GROUP,
                        with_dense: bool = False) -> QuantWeight:
        """Asymmetric min-max quantization of a float `[N, K]` weight, per group of K."""
        groups = w.float().reshape(w.shape[0], -1, group_size)  # [N, K / G, G]
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
        return cls(4, q.reshape(w.shape).to(torch.uint8), scale, lo + 8 * scale, group_size,
                   with_dense)

    @classmethod
    def int8_from_float(cls, w: torch.Tensor, with_dense: bool = False) -> QuantWeight:
        """Symmetric per-output-channel quantization of a float `[N, K]` weight."""
        w = w.float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        q = (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
        return cls(8, q, scale, with_dense=with_dense)

    def can_cat(self, weights: list) -> bool:
        """Whether `cat` can stack these into one weight of this kind."""
        return all(type(w) is QuantWeight and w.bits == self.bits
                   and w.group_size == self.group_size and w.shape[1] == self.shape[1]
                   and w.with_dense == self.with_dense and w.q is not None for w in weights)

    @staticmethod
    def cat(weights: list[QuantWeight]) -> QuantWeight:
        """Stack along N (fused q/k/v or gate/up projections), before packing."""
        first = weights[0]
        assert all(w.bits == first.bits and w.group_size == first.group_size
                   and w.shape[1] == first.shape[1] for w in weights), "mixed quantization"
        zero = None if first.zero is None else torch.cat([w.zero for w in weights])
        return QuantWeight(first.bits, torch.cat([w.q for w in weights]),
                           torch.cat([w.scale for w in weights]), zero, first.group_size,
                           first.with_dense)

    # ------------------------------------------------------------------ use
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float `[N, K]` weight these integers stand for (the reference)."""
        if self.bits == 8:
            return (self.q.float() * self.scale.float()[:, None]).to(dtype)
        groups = self.q.float().reshape(self.shape[0], -1, self.group_size) - 8
        w = groups * self.scale.float()[..., None] + self.zero.float()[..., None]
        return w.reshape(self.shape).to(dtype)

    def pack(self, dtype: torch.dtype = torch.bfloat16) -> QuantWeight:
        """Lay the integers out for the kernel, whose inputs are cast to `dtype` (bf16: the
        CPU kernels have vectorized bf16 paths; fp32 inputs take a scalar fallback that is
        ~30x slower); frees the unpacked integers."""
        self._dtype = dtype
        if self.with_dense:  # read by every batched step: on huge pages (or oneDNN's blocks)
            dense = memory.empty(self.shape, torch.bfloat16)
            dense.copy_(self.dequantize(torch.bfloat16))
            self.dense = prepack_dense(dense)
        if cpu_qgemv.available() and cpu_qgemv.fits(*self.shape):
            self._vnni = cpu_qgemv.pack_int4(self.q, self.scale, self.zero) if self.bits == 4 \
                else cpu_qgemv.pack_int8(self.q, self.scale)
            self._packed, self._vnni_pointers = self._vnni.weight, self._vnni.pointers
        elif self.bits == 4:
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                self.q.to(torch.int32), _INNER_K_TILES)
            self._qparams = torch.stack([self.scale.t(), self.zero.t()], -1).to(dtype).contiguous()
        else:
            self._packed, self.scale = self.q.contiguous(), self.scale.to(dtype)
        self.q = self.zero = None  # the packed form is all that the kernel reads
        return self

    def vnni_layout(self) -> cpu_qgemv.Packed | None:
        """The VNNI kernel's layout of this weight (packing it first), None where that kernel
        does not run (kernels.cpu_decode reads the weights through it)."""
        if self._packed is None:
            self.pack()
        return self._vnni

    @property
    def nbytes(self) -> int:
        if self._vnni is not None:
            return self._vnni.nbytes + (0 if self.dense is None else _bytes(self.dense))
        tensors = (self._packed, self._qparams, self.scale, self.dense) \
            if self._packed is not None else (self.q, self.scale, self.zero)
        return sum(_bytes(t) for t in tensors if t is not None)

    def dense_from_rows(self) -> int | None:
        """The fewest rows `linear` runs through the bf16 dense copy (always inside a prompt
        step), None without one; packs the weight first."""
        if self._packed is None:
            self.pack()
        if self.dense is None:
            return None
        return (MAX_PACKED_ROWS if self._vnni is None else MAX_VNNI_ROWS) + 1

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`x [..., K] @ w.T + bias -> [..., N]` with the quantized kernel, in out_dtype
        (default x's dtype; the dense bf16 path then skips its conversion back)."""
        vnni = self._vnni
        if vnni is not None and bias is None and x.dtype == torch.float32 \
                and not (self.dense is not None and _prompt_step):  # the decode fast path
            rows = x.reshape(-1, vnni.k)
            if self.dense is None or rows.shape[0] <= MAX_VNNI_ROWS:
                rows = rows if rows.stride(1) == 1 else rows.contiguous()
                out = cpu_qgemv.linear(vnni, rows, self._vnni_pointers)
                if out_dtype is not None:
                    out = out.to(out_dtype)
                return out if x.dim() == 2 else out.view(*x.shape[:-1], vnni.n)
        if self._packed is None:
            self.pack()
        assert x.shape[-1] == self.shape[1], f"x [..., {self.shape[1]}] expected, got {tuple(x.shape)}"
        rows = x.reshape(-1, self.shape[1])
        limit = MAX_PACKED_ROWS if self._vnni is None else MAX_VNNI_ROWS
        if self.dense is not None and (_prompt_step or rows.shape[0] > limit):
            out = dense_linear(
                rows if rows.dtype == torch.bfloat16 else rows.to(torch.bfloat16), self.dense)
        elif self._vnni is not None:
            out = cpu_qgemv.linear(self._vnni, _fp32_rows(rows))
        elif self.bits == 4:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(self._dtype), self._packed,
                                                             self.group_size, self._qparams)
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows.to(self._dtype), self._packed,
                                                     self.scale)
        dtype = x.dtype if bias is not None or out_dtype is None else out_dtype
        if out.dtype != dtype:
            out = out.to(dtype)
        if bias is not None:
            out = out + bias
            if out_dtype is not None:
                out = out.to(out_dtype)
        return out.reshape(*x.shape[:-1], self.shape[0])


def fuse(weights: list) -> QuantWeight:
    """One weight for `[N_i, K]` parts stacked along N (fused q/k/v or gate/up): the parts'
    own `cat` where they are all one kind, else a `FusedWeight` that runs each part with its
    own kernel (a llama.cpp Q4_K_M file stores attn_v as Q6_K beside Q4_K q and k)."""
    first = weights[0]
    if isinstance(first, QuantWeight) and first.can_cat(weights):
        return type(first).cat(weights)
    return FusedWeight(weights)


class FusedWeight(QuantWeight):
    """Parts of different kinds (QuantWeights of other types, or float tensors) stacked
    along N. Kept apart rather than converted to one type: each keeps its file's bits and its
    kernel, at the cost of one matmul per part and one concatenation of their outputs. It
    has no VNNI layout of its own (the one-call decode stack runs its parts one by one,
    engine.models.llama.decode_parts), and its output comes from a bf16 GEMM from the rows
    where every part's does (dense_from_rows), so the bf16 stream takes it too."""

    def __init__(self, parts: list) -> None:
        k = parts[0].shape[1]
        assert all(p.shape[1] == k for p in parts), (
            f"fused parts must share K, got {[tuple(p.shape) for p in parts]}")
        self.parts, self.bits, self.group_size, self.with_dense = list(parts), 0, 0, False
        self.shape = torch.Size((sum(p.shape[0] for p in parts), k))
        self.dense = self.q = self.scale = self.zero = self._vnni = None
        self._packed: bool | None = None

    def can_cat(self, weights: list) -> bool:
        return False

    def pack(self, dtype: torch.dtype = torch.bfloat16) -> FusedWeight:
        for p in self.parts:
            if isinstance(p, QuantWeight):
                p.pack(dtype)
        self._packed = True
        return self

    def vnni_layout(self) -> None:
        return None

    def dense_from_rows(self) -> int | None:
        """The most of the parts' (None where one has none: its rows stay fp32)."""
        rows = [p.dense_from_rows() if isinstance(p, QuantWeight) else None for p in self.parts]
        return None if any(r is None for r in rows) else max(rows)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes if isinstance(p, QuantWeight) else _bytes(p) for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) if isinstance(p, QuantWeight) else p.to(dtype)
                          for p in self.parts])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`x [..., K] @ w.T + bias -> [..., N]`: each part's product, concatenated."""
        outs = [p.linear(x) if isinstance(p, QuantWeight)
                else torch.nn.functional.linear(x.to(p.dtype), p).to(x.dtype) for p in self.parts]
        out = torch.cat(outs, dim=-1)  # [..., N]
        if bias is not None:
            out = out + bias
        return out if out_dtype is None else out.to(out_dtype)


def prepack_dense(w: torch.Tensor) -> torch.Tensor:
    """A bf16 `[N, K]` weight in oneDNN's blocked layout for `dense_linear` (an mkldnn
    tensor), or `w` itself where torch has no oneDNN or `DUPLEX_ONEDNN_PACK=0`."""
    if switches.is_off("DUPLEX_ONEDNN_PACK") or not torch.backends.mkldnn.is_available():
        return w
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, 64)  # 64: the batch it is tuned for
    except (RuntimeError, AttributeError):
        return w


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x [M, K] bf16 @ w.T`, w plain or prepacked (`prepack_dense`)."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x if x.is_contiguous() else x.contiguous(), w,
                                                  None, "none", [], "")
    return torch.nn.functional.linear(x, w)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fp32_rows(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.float()
    return rows if rows.stride(1) == 1 else rows.contiguous()


def quant_linear_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                     dequantized: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: dequantize, then a plain fp32 matmul."""
    weight = w.dequantize(torch.float32) if dequantized is None else dequantized
    return torch.nn.functional.linear(x.float(), weight, None if bias is None else bias.float())


class QuantEmbedding:
    """An int8 embedding table with a scale per group of G columns (GGUF Q8_0): rows are
    dequantized as they are looked up, `table[ids] = q[ids] * scale[ids]` in fp32."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        assert q.dim() == 2 and q.dtype == torch.int8, f"q must be int8 [V, K], got {q.dtype}"
        assert q.shape[1] % scale.shape[1] == 0 and scale.shape[0] == q.shape[0], (
            f"scale must be [V, K / G], got {tuple(scale.shape)} for q {tuple(q.shape)}")
        self.q, self.scale, self.dtype = q, scale.float(), dtype
        self.shape = torch.Size(q.shape)
        self.group_size = q.shape[1] // scale.shape[1]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids `[T]` -> `[T, K]` in self.dtype."""
        rows = self.q.index_select(0, ids).float().view(ids.shape[0], -1, self.group_size)
        return (rows * self.scale.index_select(0, ids)[..., None]).view(ids.shape[0], -1).to(
            self.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.lookup(torch.arange(self.shape[0]))

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4
