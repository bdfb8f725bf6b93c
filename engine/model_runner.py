"""ModelRunner: owns the model weights and the device KV cache tensors; runs one step.

It turns a SchedulerOutput into one flattened varlen batch (prefill chunks and decode
tokens of many requests side by side, no padding), runs the forward, and returns the
final hidden states of the positions the caller wants logits for.

KV cache layout, one tensor for all layers:
    kv [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]
so kv[l, 0] / kv[l, 1] are layer l's contiguous k / v caches, and one block of every layer
is kv[:, :, block_id] (what the host/disk tiers and KV transfer move). An int8 pool
(`--kv-cache-dtype int8`) keeps that layout with a last dimension of head_dim + 4 bytes: each
row's int8 values, then its fp32 scale (kernels/kv_store.py), so blocks stay plain bytes.
With a hybrid layout (engine/hybrid_kv.py: a model with sliding-window layers) `kv` holds the
full-attention layers only and `swa_kv` the sliding-window layers, each with its own block
ids; the step then carries a second block table and slot mapping for the SWA layers.

The runner's `Platform` (engine/platform.py; the CPU by default) says where weights, KV and
step tensors live: step inputs are built on the host from the scheduler's numbers, laid out
in one byte buffer and moved to the device in one copy per step (`StepTransfer`; on the CPU
that buffer is the step's memory itself).
"""
from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import numpy as np
import torch

from duplex.engine.cuda_graphs import DecodeGraphs
from duplex.engine.hybrid_kv import HybridLayout, swa_step_inputs
from duplex.engine.kv_manager import KVTables
from duplex.engine.models import ForwardContext
from duplex.engine.platform import Platform, cpu, place
from duplex.engine.scheduler import ScheduledRequest
from duplex.kernels.kv_store import check_cache_dtype, row_width
from duplex.kernels.quant import prompt_step


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # int64 [num_tokens]
    ctx: ForwardContext
    sample_rows: list[int]  # index into scheduled: requests whose last token gets logits
    sample_positions: list[int]  # row in the flattened batch of that last token
    computes_prompt: bool = False  # some row is a prompt token (see quant.prompt_step)


class Feed(NamedTuple):
    """Overlapped scheduling: the step in flight's draws, from which a request whose last
    token is a placeholder (Request.add_token(PENDING)) takes that token's id on the device."""
    token_ids: torch.Tensor  # int64 [num draws], on the device
    rows: dict[str, int]  # req_id -> its row in token_ids


class StepTransfer:
    """A step's integer inputs in one byte buffer, moved to the device in one copy.

    CUDA: the host side is one of two pinned buffers used in turn (an event recorded after
    each copy says when a buffer may be written again), the copy is non-blocking, and the
    device side is a fresh buffer from torch's caching allocator, so no step's tensors alias
    another's. CPU: a fresh buffer each step, used in place (no copy)."""

    ALIGN = 16  # bytes: every segment starts aligned for its dtype's views

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self._host: list[torch.Tensor | None] = [None, None]
        self._copied: list = [None, None]  # the event after each host buffer's last copy
        self._turn = 0
        self.copies = 0  # host -> device copies made (one per step on CUDA)

    def move(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Tensors on the platform's device equal to `arrays` (int32 / int64 numpy)."""
        offsets, size = [], 0
        for a in arrays:
            offsets.append(size)
            size += -(-a.nbytes // self.ALIGN) * self.ALIGN
        host = self._host_buffer(max(size, self.ALIGN))
        flat = host.numpy()
        for a, off in zip(arrays, offsets):
            flat[off:off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        if self.platform.is_cuda:
            buf = torch.empty(host.numel(), dtype=torch.uint8, device=self.platform.device)
            buf.copy_(host, non_blocking=True)
            event = self.platform.event()
            event.record()
            self._copied[self._turn] = event
            self._turn ^= 1
            self.copies += 1
        else:
            buf = host
        return [buf[off:off + a.nbytes].view(_TORCH_INT[a.dtype.type]).view(a.shape)
                for a, off in zip(arrays, offsets)]

    def _host_buffer(self, size: int) -> torch.Tensor:
        if not self.platform.is_cuda:  # the step's own memory: never reused
            return self.platform.empty_host((size,), torch.uint8)
        turn = self._turn
        host = self._host[turn]
        if host is None or host.numel() < size:
            capacity = max(size, 2 * (0 if host is None else host.numel()))
            host = self._host[turn] = self.platform.empty_host((capacity,), torch.uint8)
        elif self._copied[turn] is not None:
            self._copied[turn].synchronize()  # the copy that read it two steps ago is done
        return host[:size]


_TORCH_INT = {np.int32: torch.int32, np.int64: torch.int64}


def check_kv_dtype(args, dtype: torch.dtype) -> None:
    """Refuse, when the model loads, a KV pool its attention cannot use: an int8 pool packs
    each (token, kv head) row as int8 values and a scale (kernels.kv_store), which the MLA
    latent cache (DeepSeek V2 / V3: its kernels read the latent as float) does not take."""
    if dtype != torch.int8:
        return
    if getattr(args, "mla", None) is not None:
        raise ValueError("--kv-cache-dtype int8 does not cover the MLA latent cache of "
                         f"{args.arch}; use auto, bfloat16 or float32")
    check_cache_dtype(dtype, args.head_dim)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 layout: HybridLayout | None = None, platform: Platform | None = None) -> None:
        args = model.args
        self.platform = platform or cpu()
        self.device = self.platform.device
        self.model = place(model, self.platform) if self.platform.is_cuda else model
        self.transfer = StepTransfer(self.platform)
        self.block_tables = BlockTables()
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs once captured (CUDA, opt-in)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layout = layout
        self.swa_kv = None
        check_kv_dtype(args, dtype)
        if layout is not None:
            self.kv, self.swa_kv, self.kv_caches = layout.allocate(args, block_size, dtype,
                                                                   self.device)
            return
        self.kv = self.platform.zeros((args.num_layers, 2, num_blocks, block_size,
                                       args.num_kv_heads, row_width(args.head_dim, dtype)),
                                      dtype)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(args.num_layers)]

    def capture_decode_graphs(self, max_model_len: int, max_batch: int) -> None:
        """CUDA graphs of decode steps, one per batch size up to max_batch
        (engine/cuda_graphs.py); on CUDA only, and not for the hybrid KV layout, whose steps
        carry a second block table."""
        if self.platform.is_cuda and self.layout is None:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size,
                                       max_model_len, self.platform, max_batch)

    @staticmethod
    def bytes_per_block(args, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block of every layer (an int8 row: head_dim values and its scale)."""
        row = row_width(args.head_dim, dtype) * dtype.itemsize
        return args.num_layers * 2 * block_size * args.num_kv_heads * row

    def prepare(self, scheduled: Sequence[ScheduledRequest], tables: KVTables,
                feed: Feed | None = None) -> StepInputs:
        """Host lists first (one pass over the requests), then one tensor per input; block
        tables come from the KV manager's `tables`, by request id. A row whose last token
        is a placeholder takes its id from `feed`, on the device."""
        bs = self.block_size
        block_tables = [tables.full[req.req_id] for req, _ in scheduled]
        ids, positions, slots = [], [], []
        query_lens, seq_lens, sample_rows, sample_positions = [], [], [], []
        fed, feed_rows = [], []  # flattened rows whose id is fed, and their rows in the feed
        num_rows, slots_valid, computes_prompt = 0, True, False
        for row, (req, num_new) in enumerate(scheduled):
            start = req.num_computed_tokens
            end = start + num_new
            computes_prompt |= start < req.num_prompt_tokens
            ids.extend(req.token_slice(start, end))
            positions.extend(range(start, end))
            slots.extend(_slots(block_tables[row], start, end, bs))
            if req.replay_end > start:  # replayed for SWA only: full layers keep their KV
                slots[num_rows:num_rows + min(num_new, req.replay_end - start)] = \
                    [-1] * min(num_new, req.replay_end - start)
                slots_valid = False
            num_rows += num_new
            if getattr(req, "num_pending", 0):  # one placeholder, the last token (Scheduler)
                assert req.num_pending == 1 and end == req.num_tokens, "one placeholder, last"
                fed.append(num_rows - 1)
                feed_rows.append(feed.rows[req.req_id])
            query_lens.append(num_new)
            seq_lens.append(end)
            if end >= req.num_tokens:  # the prompt is fully computed: this step samples
                sample_rows.append(row)
                sample_positions.append(num_rows - 1)
        max_blocks = max(1, max(map(len, block_tables)))
        table = self.block_tables.table([req.req_id for req, _ in scheduled], block_tables,
                                        max_blocks)
        arrays = [np.asarray(ids, dtype=np.int64), np.asarray(positions, dtype=np.int64),
                  np.asarray(slots, dtype=np.int64), table,
                  np.asarray([0, *itertools.accumulate(query_lens)], dtype=np.int32),
                  np.asarray(seq_lens, dtype=np.int32)]
        if self.layout is not None:
            num_cols = max(max_blocks, *(len(tables.swa[s.req.req_id]) for s in scheduled))
            swa_tables, swa_slots = swa_step_inputs(scheduled, tables.swa, bs,
                                                    self.layout.null_block, num_cols)
            arrays += [swa_tables.numpy(), swa_slots.numpy()]
        if fed:
            arrays += [np.asarray(fed, dtype=np.int64), np.asarray(feed_rows, dtype=np.int64)]
        moved = self.transfer.move(arrays)  # one host -> device copy (none on the CPU)
        if fed:  # the ids drawn by the step in flight, device to device
            moved[0].index_copy_(0, moved[-2], feed.token_ids.index_select(0, moved[-1]))
        input_ids, positions_t, slots_t, table_t, starts_t, seq_lens_t = moved[:6]
        ctx = ForwardContext(
            positions=positions_t, slot_mapping=slots_t, block_tables=table_t,
            query_start_loc=starts_t, seq_lens=seq_lens_t, kv_caches=self.kv_caches,
            query_lens=query_lens, host_seq_lens=seq_lens, block_size=bs,
            slots_valid=slots_valid)
        if self.layout is not None:
            ctx.swa_block_tables, ctx.swa_slot_mapping = moved[6:8]
        return StepInputs(input_ids, ctx, sample_rows, sample_positions, computes_prompt)

    def end_step(self) -> None:
        """Once per step, after its forward(s) and sampling: the model closes its per-step
        state (a MoE model's expert statistics, expert-parallel rebalancing)."""
        end_step = getattr(self.model, "end_step", None)
        if end_step is not None:
            end_step()

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, logit_positions: list[int] | None = None) -> torch.Tensor:
        """Run the forward; fp32 logits [len(positions), vocab] for the sampled positions
        (or the given ones)."""
        # a graph gives every row's logits: for steps where every row samples (a row that
        # recomputes a preempted request's output token one at a time does not)
        if self.graphs is not None and logit_positions is None \
                and len(inputs.sample_positions) == inputs.input_ids.shape[0]:
            logits = self.graphs.run(inputs.input_ids, inputs.ctx, inputs.computes_prompt)
            if logits is not None:
                return logits
        with prompt_step(inputs.computes_prompt):
            hidden = self.model.forward(inputs.input_ids, inputs.ctx)
            rows = inputs.sample_positions if logit_positions is None else logit_positions
            if not rows:
                return torch.empty(0, self.model.args.vocab_size, device=hidden.device)
            if rows != list(range(hidden.shape[0])):
                hidden = hidden[torch.tensor(rows, device=hidden.device)]
            return self.model.compute_logits(hidden)


class _Row(NamedTuple):
    block_ids: list[int]  # the KV manager's table this row copies (the object itself)
    ids: np.ndarray  # int32, its block ids in [:length], spare room after
    length: int


class BlockTables:
    """Each running request's block-table row, kept on the host between steps: a step
    appends the blocks a request gained since the last one, rewrites a row only when the
    KV manager replaced or cut its table (then a new list: engine.kv_manager's contract,
    so a row is kept while its table is the same object), and copies rows from arrays
    instead of converting Python lists. Rows of requests a step no longer runs are dropped
    once they outnumber the step's by KEEP_ROWS."""
    KEEP_ROWS = 4

    def __init__(self) -> None:
        self.rows: dict[str, _Row] = {}

    def table(self, req_ids: Sequence[str], block_tables: Sequence[list[int]],
              num_cols: int) -> np.ndarray:
        """int32 [len(req_ids), num_cols]: row i = block_tables[i] (req_ids[i]'s table),
        zeros after."""
        table = np.zeros((len(req_ids), num_cols), dtype=np.int32)
        for i, (req_id, block_ids) in enumerate(zip(req_ids, block_tables)):
            row = self._row(req_id, block_ids)
            table[i, :row.length] = row.ids[:row.length]
        if len(self.rows) > self.KEEP_ROWS * max(len(req_ids), 16):
            self.rows = {req_id: self.rows[req_id] for req_id in req_ids}
        return table

    def _row(self, req_id: str, block_ids: list[int]) -> _Row:
        n = len(block_ids)
        row = self.rows.get(req_id)
        if row is None or row.block_ids is not block_ids or row.length > n:
            buf = np.empty(max(16, 2 * n), dtype=np.int32)
            buf[:n] = block_ids
            row = _Row(block_ids, buf, n)
        elif row.length < n:
            buf = row.ids
            if len(buf) < n:
                buf = np.empty(2 * n, dtype=np.int32)
                buf[:row.length] = row.ids[:row.length]
            buf[row.length:n] = block_ids[row.length:]
            row = _Row(block_ids, buf, n)
        else:
            return row
        self.rows[req_id] = row
        return row


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV cache slots of positions [start, end) of a request with this block table."""
    if end - start == 1:
        return [block_ids[start // block_size] * block_size + start % block_size]
    pos = np.arange(start, end)
    return (np.asarray(block_ids, dtype=np.int64)[pos // block_size] * block_size
            + pos % block_size).tolist()
