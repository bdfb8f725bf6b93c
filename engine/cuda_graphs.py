"""CUDA graphs of decode steps: the forward and the logits of a batch whose every row decodes
(one query, no prompt token), captured once per batch size in CAPTURE_SIZES and replayed
with the step's inputs copied into the graph's static buffers.

A step of n rows runs as the smallest captured size B >= n. Rows n..B-1 are padding:
sequences of length 0 with KV slot -1, so they write no KV, attention sees no key for them
(their output row is zero) and their logits are dropped. Block-table columns past the
step's width and the padding rows' stale entries are never read (a row reads only the
blocks of its first seq_len positions).

What the host decides is fixed at capture: one query a row, and the split-KV attention
grid sized for GRAPH_MAX_LEN keys (programs past a sequence's end are idle). A step with a
longer sequence, a prompt token, a second query for a row (speculation), a hybrid KV layout
or more rows than the largest size runs eagerly, as does everything off CUDA.

`capture=False` keeps the static buffers and the padding and runs the forward eagerly on
them: the CPU tests use it under triton's interpreter (`kernels._triton.on_cpu`), the
device kernel path, to check all of this except the capture itself.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from duplex.engine.models import ForwardContext
from duplex.engine.platform import Platform
from duplex.kernels import ops

log = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
GRAPH_MAX_LEN = 8192  # keys a captured step's attention grid covers (its partials' memory)


class _Buffers(NamedTuple):
    input_ids: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # int64 [B]
    slot_mapping: torch.Tensor  # int64 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]


class _Captured(NamedTuple):
    buffers: _Buffers
    graph: object | None  # torch.cuda.CUDAGraph; None: run eagerly on the buffers
    logits: torch.Tensor | None  # the graph's output [B, vocab]


class DecodeGraphs:
    def __init__(self, model, kv_caches, block_size: int, max_model_len: int,
                 platform: Platform, max_batch: int, capture: bool = True) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.platform = platform
        self.max_len = min(max_model_len, GRAPH_MAX_LEN)
        self.max_blocks = -(-self.max_len // block_size)
        self.sizes = [s for s in CAPTURE_SIZES if s < max_batch] + [max_batch]
        self.capture = capture
        self.replays = 0  # steps that ran through a graph (or its eager stand-in)
        self._pool = None
        self._graphs: dict[int, _Captured] = {}
        for size in sorted(self.sizes, reverse=True):  # the largest first: the pool fits all
            self._graphs[size] = self._build(size)

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext,
            computes_prompt: bool) -> torch.Tensor | None:
        """The step's logits [n, vocab] through its graph, or None when it must run eagerly."""
        n = input_ids.shape[0]
        # the device kernels take their masks from the device lengths (the captured host
        # lengths only size their grids); the CPU path would build its masks from the latter
        if not ops.runs_triton(input_ids) or computes_prompt or ctx.query_lens is None \
                or ctx.host_seq_lens is None or ctx.swa_block_tables is not None \
                or n > self.sizes[-1] \
                or len(ctx.query_lens) != n or max(ctx.host_seq_lens) > self.max_len \
                or ctx.block_tables.shape[1] > self.max_blocks:
            return None
        size = next(s for s in self.sizes if s >= n)
        captured = self._graphs[size]
        b = captured.buffers
        b.input_ids[:n].copy_(input_ids)
        b.positions[:n].copy_(ctx.positions)
        b.slot_mapping[:n].copy_(ctx.slot_mapping)
        b.slot_mapping[n:].fill_(-1)
        b.block_tables[:n, :ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        b.seq_lens[:n].copy_(ctx.seq_lens)
        b.seq_lens[n:].zero_()
        self.replays += 1
        if captured.graph is None:
            return self._forward(b, size)[:n]
        captured.graph.replay()
        return captured.logits[:n]

    def _build(self, size: int) -> _Captured:
        device = self.platform.device
        b = _Buffers(
            input_ids=torch.zeros(size, dtype=torch.long, device=device),
            positions=torch.zeros(size, dtype=torch.long, device=device),
            slot_mapping=torch.full((size,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros((size, self.max_blocks), dtype=torch.int32, device=device),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(size, dtype=torch.int32, device=device))
        if not self.capture:
            return _Captured(b, None, None)
        # warm up on a side stream (triton compiles, the allocator settles); every slot is -1
        # and every length 0, so neither this nor the capture writes or reads the KV cache
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(b, size)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(b, size)
        self._pool = graph.pool()
        log.info("captured the decode step for batch %d", size)
        return _Captured(b, graph, logits)

    @torch.inference_mode()
    def _forward(self, b: _Buffers, size: int) -> torch.Tensor:
        # a fresh context each run: it memoizes what it builds from the buffers (rope tables)
        ctx = ForwardContext(
            positions=b.positions, slot_mapping=b.slot_mapping, block_tables=b.block_tables,
            query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, kv_caches=self.kv_caches,
            query_lens=[1] * size, host_seq_lens=[self.max_len] * size,
            block_size=self.block_size, slots_valid=False, counted=b.seq_lens > 0)
        return self.model.compute_logits(self.model.forward(b.input_ids, ctx))
