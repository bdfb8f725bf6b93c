"""EngineCore: the worker's engine, free of sockets: add / abort requests, step, report.

    step = [draft] -> schedule -> prepare inputs -> forward -> sample or verify
           -> update requests -> deltas

Each mode has its own step function, chosen once at construction: `_step_plain`,
`_step_overlap` (overlapped scheduling) and `_step_spec` (speculation). Every request
leaves through `finish(req, reason)`: a stop, its length, an abort or an error.

With speculation on (engine/spec), decoding requests first get draft tokens; they ride in
the same flattened batch as every other request's tokens, the runner returns logits for
each draft row and the bonus row, and verification appends the accepted drafts plus one
token, after which the rejected drafts' KV is dropped (num_computed_tokens rolls back,
KVCacheManager.trim frees blocks that held nothing else).

With overlapped scheduling (`--overlap`; auto: on a GPU) a step is launched, not finished:
its requests advance at once, each sampled one with a placeholder token, and its tokens are
read ("landed") only after the next step has been scheduled and launched, that step taking
the placeholders' ids from the device (model_runner.Feed). So the device runs step n while
the host schedules step n+1 and then settles step n:

    step = schedule n+1 -> launch n+1 (inputs fed from n's draws) -> land n -> deltas of n

A request that stopped on one of step n's tokens was in step n+1 too; that row is dropped.
While a request needs its ids on the host before its next draw (penalties, a grammar), each
step lands before the next is scheduled; speculation and expert parallelism keep it off.

The worker process (engine/worker.py) drives it from one thread at a time; the offline
API (engine/llm.py) drives it in-process. Both see the same RequestDelta stream.
"""
from __future__ import annotations

import json
import logging
import os
import time
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

from duplex.engine.block_pool import BlockPool
from duplex.engine.config import EngineConfig, SchedulerConfig, available_cores, resolve_model_path
from duplex.engine.cost_model import CostModel, StepFeatures, step_features
from duplex.engine.grammar import Grammars
from duplex.engine.hybrid_kv import HybridKVCacheManager, HybridLayout
from duplex.engine.kv_manager import KVCacheManager
from duplex.engine.kv_tiers import DEVICE, DISK, HOST, SHARED, BlockCodec, KVTiers, TierLink
from duplex.engine.messages import AddRequest, FinishReason, RequestDelta, WorkerStats
from duplex.engine.model_runner import Feed, ModelRunner
from duplex.engine.models import build_model, load
from duplex.engine.platform import Platform, place, resolve
from duplex.engine.request import PENDING, Request, Status, Stop
from duplex.engine.sampler import Draws, Sampler, take_rows
from duplex.engine.scheduler import Scheduler, SchedulerOutput
from duplex.engine.spec import Speculator
from duplex.engine.stats import KVStats, KVTierStats, MoEStats
from duplex.engine.step_policy import shortest_first, time_budget
from duplex.kernels import memory
from duplex.kernels.batch_invariant import set_batch_invariant_mode
from duplex.kernels.cpu_fused import use_fused
from duplex.kernels.quant import QuantEmbedding, QuantWeight
from duplex.kvstore import keys as kvkeys
from duplex.kvstore import retention

log = logging.getLogger("duplex.engine")

KV_LAYOUT = "kv[layer,2,block,slot,kv_head,head_dim]"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_KV_DTYPES = {**_DTYPES, "int8": torch.int8}  # int8: packed rows with a scale (kernels.kv_store)
_KV_DTYPE_NAMES = {v: k for k, v in _KV_DTYPES.items()}


def step_policies(config: SchedulerConfig, cost_model: CostModel) -> dict:
    """The Scheduler's policies for this config: a time budget from the cost model when
    step_budget_ms is set, the shortest-first prompt order when fair_prefill is asked for."""
    budget = config.step_budget_ms / 1000.0
    return dict(token_budget=time_budget(cost_model, budget) if budget > 0 else None,
                prefill_order=shortest_first() if config.fair_prefill else None)


def _load_weights(config: EngineConfig, progress: bool, platform: Platform):
    """(loaded model, dtype, quantization, model path) of the config's model and precision."""
    dtype, quant = resolve_precision(config, platform)
    model_path = resolve_model_path(config.model)
    loaded = load(model_path, dtype, progress=progress, quant=quant)
    if not any(isinstance(w, (QuantWeight, QuantEmbedding)) for w in loaded.state_dict.values()):
        quant = "none"  # auto on float weights (an HF directory): the exact path
    return loaded, dtype, quant, model_path


def _size_kv_pool(config: EngineConfig, args, dtype: torch.dtype, is_hybrid: bool,
                  platform: Platform) -> tuple[int, HybridLayout | None]:
    """(full-attention KV blocks, hybrid layout or None): num_kv_blocks, or as many blocks as
    the platform's pool holds (kv_cache_bytes on the CPU, free memory on a GPU); a hybrid
    layout splits them between full and window layers."""
    cache = config.cache
    num_blocks = cache.num_kv_blocks or max(
        2, platform.kv_pool_bytes(cache.kv_cache_bytes, config.gpu_memory_utilization)
        // ModelRunner.bytes_per_block(args, cache.block_size, dtype))
    if not is_hybrid:
        return num_blocks, None
    layout = HybridLayout.plan(args.layer_windows, num_blocks, cache.block_size,
                               config.scheduler.max_num_seqs,
                               resolve_batched_tokens(config, platform))
    return layout.num_full_blocks, layout


def resolve_precision(config: EngineConfig, platform: Platform) -> tuple[torch.dtype, str]:
    """(activation and KV dtype, loader quantization) of `config.weights_dtype`: auto keeps
    a GGUF file's 4/8-bit linear weights quantized (fp32 activations) on the CPU, except in
    batch-invariant mode, whose fixed-order matmuls need float weights; on a GPU auto is the
    platform's dtype (bf16), the quantized matmuls being CPU kernels."""
    name = config.weights_dtype
    if platform.is_cuda:
        if name in ("int4", "int8"):
            raise ValueError(f"--dtype {name} runs on the CPU's quantized kernels only; on "
                             f"{platform.device} use auto, bfloat16 or float32")
        if name == "auto":
            return platform.default_dtype, "none"
    if name in _DTYPES:
        return _DTYPES[name], "none"
    if name == "auto":
        return torch.float32, "none" if config.batch_invariant else "auto"
    return torch.float32, name  # int4 / int8


def resolve_kv_dtype(config: EngineConfig, dtype: torch.dtype, quant: str) -> torch.dtype:
    """The KV pool's element type: `config.cache.kv_cache_dtype`, where auto is bf16 beside
    quantized weights (the CPU's fast, not bitwise-exact mode: decode attention then reads
    half the bytes, kernels/cpu_attention.c) and the activations' dtype otherwise (the exact
    float32 mode and batch invariance keep fp32 KV). int8 is never auto: it is an opt-in that
    trades a measured bit of quality (bench/quality.py) for ~1.9x the context per byte; the
    model refuses it where its attention cannot read it (model_runner.check_kv_dtype)."""
    name = config.cache.kv_cache_dtype
    if name == "auto":
        return torch.bfloat16 if quant != "none" else dtype
    return _KV_DTYPES[name]


def kv_format(config: EngineConfig, quant: str, dtype: torch.dtype,
              kv_dtype: torch.dtype) -> str:
    """What the KV's values depend on besides the model: key namespaces and the hand-off's
    compatibility check carry it, so blocks of another precision (int8 rows among bf16 ones)
    are never mixed in."""
    return f"{config.weights_dtype}/{quant}/{_DTYPE_NAMES[dtype]}/kv={_KV_DTYPE_NAMES[kv_dtype]}"


def _build_kv(config: EngineConfig, runner: ModelRunner, tiers: KVTiers | None,
              namespace: _Namespaces) -> tuple[BlockPool, KVCacheManager]:
    """The device block pool and its manager (hybrid with the runner's sliding-window
    layout), linked to the tiers below when there are any."""
    num_blocks, block_size, layout = runner.num_blocks, runner.block_size, runner.layout
    link = None if tiers is None else \
        TierLink(tiers, BlockCodec(runner.kv, runner.platform), num_blocks)
    pool = BlockPool(num_blocks, on_evict=link.on_evict if link else None)
    caching = config.cache.enable_prefix_caching
    if layout is None:
        return pool, KVCacheManager(pool, block_size, namespace, caching, tiers=link)
    return pool, HybridKVCacheManager(
        pool, BlockPool(layout.num_swa_blocks), layout, block_size, namespace, caching,
        tiers=link, block_bytes=layout.bytes_per_block(runner.model.args, block_size,
                                                      runner.kv.dtype))


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = True, *,
                 cost_model: CostModel | None = None,
                 platform: Platform | None = None) -> None:
        """`cost_model`: the step-time model the time budget and speculation read (a fresh
        one, fitted on every step, unless given). `platform`: where weights, KV and step
        tensors live (engine/platform.py; default: config.device resolved)."""
        self.config = config
        self.platform = platform or resolve(config.device)
        if config.ep.is_on and not torch.distributed.is_initialized():
            raise ValueError("--expert-parallel N runs under `duplex serve` or `duplex worker`, "
                             "which form the group of N processes (engine/ep_group.py)")
        # one torch thread per core this process may run on (the supervisor splits them), once
        self.num_threads = config.num_threads or available_cores()
        torch.set_num_threads(self.num_threads)
        loaded, self.dtype, self.quant, self.model_path = _load_weights(config, progress,
                                                                        self.platform)
        self.weights_label = _DTYPE_NAMES[self.dtype] if self.quant == "none" else \
            f"{self.quant} (quantized linears, fp32 activations)"
        self.kv_dtype = resolve_kv_dtype(config, self.dtype, self.quant)
        self.kv_format = kv_format(config, self.quant, self.dtype, self.kv_dtype)
        self.args, self.model_name, self.model_identity = loaded.args, loaded.name, loaded.identity
        self.vocab_size = self.args.vocab_size
        self.block_size = config.cache.block_size
        is_hybrid = uses_hybrid_kv(config, self.args)  # before the model is built: it may refuse
        self.kv_layout = KV_LAYOUT + ("+hybrid" if is_hybrid else "")
        self._namespace = _Namespaces(self.model_identity, self.kv_format, self.block_size,
                                      self.kv_layout)  # of each tenant
        self.tiers = KVTiers.from_config(config, self._namespace(None)) \
            if config.cache.enable_prefix_caching else None  # first: a bad --kv-dir fails fast
        self.model = build_model(loaded.args, loaded.state_dict)
        if self.platform.is_cuda:
            place(self.model, self.platform)  # before the KV pool is sized from free memory
        self.max_model_len = min(config.max_model_len or self.args.max_position_embeddings,
                                 self.args.max_position_embeddings)
        self.eos_token_ids = _eos_token_ids(self.args, self.model_path)
        self.num_kv_blocks, self.layout = _size_kv_pool(config, self.args, self.kv_dtype,
                                                        is_hybrid, self.platform)
        self.runner = ModelRunner(self.model, self.num_kv_blocks, self.block_size, self.kv_dtype,
                                  self.layout, self.platform)
        self.pool, self.kv = _build_kv(config, self.runner, self.tiers, self._namespace)
        if config.cuda_graphs and not config.ep.is_on:  # CUDA: decode steps replay graphs
            self.runner.capture_decode_graphs(self.max_model_len, config.scheduler.max_num_seqs)
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self.scheduler = Scheduler(
            self.kv, config.scheduler.max_num_seqs, resolve_batched_tokens(config, self.platform),
            self.max_model_len, **step_policies(config.scheduler, self.cost_model))
        self.sampler = Sampler(config.seed)
        self.spec = None if not config.spec.is_on else Speculator.build(
            config.spec, model=self.model, runner=self.runner, kv=self.kv,
            load_model=partial(_load_model, self.dtype, self.quant), cost_model=self.cost_model,
            num_kv_blocks=self.num_kv_blocks, block_size=self.block_size, dtype=self.kv_dtype,
            max_model_len=self.max_model_len, seed=config.seed)
        self.grammar = Grammars.for_model(self.model_path, self.args.vocab_size,
                                          self.eos_token_ids, blocking=config.ep.is_on)
        self.requests: dict[str, Request] = {}
        self._in_flight: _Flight | None = None
        self.overlap = resolve_overlap(config, self.platform)  # step n+1 before n's tokens
        self._pending_deltas: list[RequestDelta] = []
        self._counters = dict(prompt=0, computed=0, cached=0, generated=0, steps=0,
                              requests=0, aborted=0)

    # ------------------------------------------------------------------ requests
    def add_request(self, msg: AddRequest) -> None:
        if msg.req_id in self.requests:
            raise ValueError(f"request id {msg.req_id!r} is already in use")
        _check_request(msg, self.args.vocab_size, self.max_model_len,
                       self.num_kv_blocks * self.block_size)
        max_tokens = self.max_model_len - len(msg.prompt_token_ids)
        if msg.params.max_tokens is not None:
            max_tokens = min(max_tokens, msg.params.max_tokens)
        req = Request(msg.req_id, msg.prompt_token_ids, msg.params, self.eos_token_ids,
                      arrival_time=msg.arrival_time or None, cache_salt=msg.cache_salt,
                      retention=msg.retention, max_tokens=max_tokens)  # deadline: the worker's
        for token_id in msg.output_token_ids:  # generated elsewhere: continue after them
            req.add_token(token_id)
        self.requests[req.req_id] = req
        self._counters["prompt"] += req.num_prompt_tokens
        self._counters["requests"] += 1
        if msg.params.constraint is not None:
            self.grammar.submit(req)  # scheduled once its grammar is compiled
            return
        self.scheduler.add(req)
        self.kv.start_loads(req)

    def abort_requests(self, req_ids: list[str], error: str = "") -> None:
        """End these requests (unknown ids are skipped); each one's final delta, finish
        "abort" with `error` (why: engine.deadlines, a shutdown), leads the next step's."""
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            self._counters["aborted"] += 1
            self.finish(req, FinishReason.ABORT)
            self._pending_deltas.append(_delta(req, [], [], error=error))

    def finish(self, req: Request, reason: FinishReason, stop_token: int | None = None) -> None:
        """End req, whatever ended it (a stop, its length, an abort, an error): the one way
        out. Its grammar, drafter state, queue place and KV blocks are released once each,
        then the request takes its finish reason. Only finished requests that were not
        aborted count their cached prompt tokens."""
        self.requests.pop(req.req_id, None)
        self.grammar.free(req.req_id)
        if self.spec is not None:
            self.spec.free(req)
        self.scheduler.remove(req)  # its queue place and KV blocks
        req.finish(reason, stop_token)
        if reason != FinishReason.ABORT:
            self._counters["cached"] += max(0, req.num_cached_tokens)

    def has_request(self, req_id: str) -> bool:
        """Whether req_id runs here (added, neither finished nor aborted yet)."""
        return req_id in self.requests

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._pending_deltas) or \
            self.grammar.num_waiting > 0 or self._in_flight is not None

    # ------------------------------------------------------------------ one step
    @property
    def overlap(self) -> bool:
        """Overlapped scheduling (resolve_overlap); never on with speculation."""
        return self._step == self._step_overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        """Choose the step function of this engine's mode: speculation, overlapped or plain
        (set at construction; a benchmark may switch between steps, none in flight)."""
        assert self._in_flight is None, "switch modes with no step in flight"
        self._step = self._step_spec if self.spec is not None else \
            self._step_overlap if on else self._step_plain

    def step(self) -> list[RequestDelta]:
        """Deltas owed from before (aborts, failed grammars; compiled ones join the
        scheduler), then this mode's step: _step_plain, _step_overlap or _step_spec."""
        deltas, self._pending_deltas = self._pending_deltas, []
        self._admit_compiled(deltas)
        # fused CPU RMSNorm / SiLU round unlike torch: for quantized weights only, never in
        # the exact float32 mode (kernels.cpu_fused)
        with use_fused(self.quant != "none"):
            return deltas + self._step()

    def _step_plain(self) -> list[RequestDelta]:
        """Schedule, run, read the tokens and settle: one step, done when it returns."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            _idle(self.grammar)
            return []
        self._in_flight = self._launch(sched)
        return self._land()

    def _step_overlap(self) -> list[RequestDelta]:
        """Schedule and launch step n+1, then land step n (module docstring). While a
        request needs its tokens on the host first, step n lands before n+1 is scheduled."""
        overlaps = not _needs_host_tokens(self.requests.values())
        deltas = [] if overlaps else self._land()  # the next step needs those tokens
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self._in_flight is None:
                _idle(self.grammar)
            return deltas + self._land()
        flight = self._launch(sched)
        deltas += self._land()  # the step before, read while `flight` runs on the device
        self._in_flight = flight
        return deltas if overlaps else deltas + self._land()

    def _step_spec(self) -> list[RequestDelta]:
        """Draft, schedule, then verify the drafts against the step's logits on the host,
        before the next step is scheduled (the next drafts start from its tokens)."""
        self.spec.propose(self.scheduler.running)
        self.grammar.clip_drafts(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            _idle(self.grammar)
            return []
        self.spec.clip(sched.scheduled)
        features, start = step_features(sched.scheduled), time.perf_counter()
        inputs = self.runner.prepare(sched.scheduled, self.kv.tables)
        sampled = [sched.scheduled[row].req for row in inputs.sample_rows]
        rows = Speculator.logit_rows(inputs.sample_positions, sampled)
        # batch-invariant ops are a process-wide switch: set it for this engine's step only
        with set_batch_invariant_mode(self.config.batch_invariant):
            logits = self.runner.execute(inputs, rows)
            out = self._sample(logits, sampled)
        self.runner.end_step()  # after the sampler read the tokens: nothing left to wait for
        _advance(sched, self._counters)
        deltas = self._settle(sched, out)
        self.cost_model.observe(features, time.perf_counter() - start)
        _count_step(self._counters)
        return deltas

    def _launch(self, sched: SchedulerOutput) -> _Flight:
        """Queue a step's forward and draws on the device, without waiting for them: its
        requests advance at once, each sampled one with a placeholder token (its id is read
        when the step lands); a placeholder of the step in flight is fed from the device."""
        features, start = step_features(sched.scheduled), time.perf_counter()
        flying = self._in_flight
        inputs = self.runner.prepare(sched.scheduled, self.kv.tables,
                                     None if flying is None else flying.feed)
        sampled = [sched.scheduled[row].req for row in inputs.sample_rows]
        with set_batch_invariant_mode(self.config.batch_invariant):
            logits = self.runner.execute(inputs)
            draws = self.sampler.launch(logits, sampled, self.grammar.masks(sampled))
        _advance(sched, self._counters)
        for req in sampled:
            req.add_token(PENDING)
        feed = Feed(draws.token_ids, {req.req_id: i for i, req in enumerate(sampled)})
        return _Flight(sched, sampled, draws, feed, features, start)

    def _land(self) -> list[RequestDelta]:
        """The step in flight, if any: its tokens read back, put in their placeholders, and
        its requests settled (a request that ended meanwhile, by abort or by an earlier
        token, is skipped: its placeholder was a wasted row)."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        result = flight.draws.result()
        self.runner.end_step()  # after the tokens were read: nothing left to wait for
        out = {req.req_id: _Sampled([token_id], [logprob], 0, 0) for req, token_id, logprob
               in zip(flight.sampled, result.token_ids, result.logprobs)}
        deltas = self._settle(flight.sched, out)
        self.cost_model.observe(flight.features, time.perf_counter() - flight.start)
        _count_step(self._counters)
        return deltas

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> dict[str, _Sampled]:
        """New tokens of each sampled request: one from the sampler, or, for a request with
        drafts, its accepted drafts and one more from verification (logits rows: a drafting
        request's k draft rows and its bonus row, one row for the others, in order)."""
        out, plain, row = {}, [], 0
        for req in reqs:
            num_drafts = len(req.spec_token_ids)
            if num_drafts:
                rows = logits[row:row + num_drafts + 1]
                if self.grammar.has(req):  # each row masked as the sampler would mask it
                    rows = rows.masked_fill(~self.grammar.draft_masks(req), float("-inf"))
                verified = self.spec.verify(req, rows, self.sampler.generator)
                token_ids = verified.token_ids
                logprobs = self.sampler.logprobs(logits[row:row + len(token_ids)],
                                                 [req] * len(token_ids), token_ids)
                out[req.req_id] = _Sampled(token_ids, logprobs, num_drafts, verified.num_accepted)
            else:
                plain.append((row, req))
            row += num_drafts + 1
        if plain:
            plain_reqs = [req for _, req in plain]
            result = self.sampler(take_rows(logits, [r for r, _ in plain]), plain_reqs,
                                  self.grammar.masks(plain_reqs))
            for (_, req), token_id, logprob in zip(plain, result.token_ids, result.logprobs):
                out[req.req_id] = _Sampled([token_id], [logprob], 0, 0)
        return out

    def _settle(self, sched: SchedulerOutput, sampled: dict[str, _Sampled]) -> list[RequestDelta]:
        deltas = []
        for req, _ in sched.scheduled:
            if req.status is Status.FINISHED:  # aborted, or ended while this step flew
                continue
            out = sampled.get(req.req_id)  # None: a prefill chunk short of the prompt's end
            appended = None if out is None else \
                _append(req, out, self.max_model_len, self.grammar)
            if req.spec_token_ids:
                # verified: rejected drafts' KV is no longer computed (their slots are
                # overwritten later); blocks that held only those slots are freed
                req.rollback()
                self.kv.trim(req)
            self.kv.publish(req)
            if appended is None:
                continue
            num, stop = appended
            self._counters["generated"] += num
            if stop is not None:
                self.finish(req, *stop)
            deltas.append(_token_delta(req, out, num))
        return deltas


    def _admit_compiled(self, deltas: list[RequestDelta]) -> None:
        """Requests whose grammar finished compiling join the scheduler; a grammar that
        failed ends its request with an error."""
        ready, failed = self.grammar.take_ready()
        for req in ready:
            self.scheduler.add(req)
            self.kv.start_loads(req)
        for req, error in failed:
            self.finish(req, FinishReason.ERROR)
            deltas.append(_delta(req, [], [], error=f"grammar: {error}"))

    # ------------------------------------------------------------------ stats
    def close(self) -> None:
        """Flush queued KV writes to disk and release the KV directory. Idempotent."""
        self.grammar.close()
        if self.tiers is not None:
            self.tiers.close()

    def stats(self) -> WorkerStats:
        c = self._counters
        return WorkerStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_total=self.num_kv_blocks, num_kv_blocks_used=self.pool.num_used_blocks,
            num_prompt_tokens=c["prompt"], num_computed_prompt_tokens=c["computed"],
            num_cached_prompt_tokens=c["cached"], num_generated_tokens=c["generated"],
            num_preemptions=self.scheduler.num_preemptions, num_steps=c["steps"],
            num_requests_added=c["requests"], num_requests_aborted=c["aborted"],
            kv=_kv_stats(self.kv, self.pool, self.tiers, ModelRunner.bytes_per_block(
                self.args, self.block_size, self.kv_dtype)),
            cost=self.cost_model.stats(), grammar=self.grammar.stats(),
            spec=self.spec.report() if self.spec is not None else None, moe=_moe_stats(self.model))


class _Namespaces:
    """Key namespace of a tenant (cache_salt: hex of its salt), made once per tenant; None:
    the model-level namespace, no tenant, which guards the disk tier's files."""

    def __init__(self, model_identity: str, kv_format: str, block_size: int,
                 kv_layout: str) -> None:
        self._parts = (model_identity, kv_format, block_size, kv_layout)
        self._made: dict[str | None, bytes] = {}

    def __call__(self, cache_salt: str | None) -> bytes:
        ns = self._made.get(cache_salt)
        if ns is None:
            salt = b"" if cache_salt is None else kvkeys.salt_from_wire(cache_salt)
            ns = self._made[cache_salt] = kvkeys.namespace(*self._parts, salt)
        return ns


class _Flight(NamedTuple):
    """A step launched on the device and not yet landed (its tokens not read)."""
    sched: SchedulerOutput
    sampled: list[Request]  # in the draws' row order
    draws: Draws
    feed: Feed  # what the next step's placeholders read
    features: StepFeatures
    start: float


class _Sampled(NamedTuple):
    """A request's new tokens from one step (before stop checks)."""
    token_ids: list[int]
    logprobs: list
    num_proposed: int  # drafts verified
    num_accepted: int  # of which accepted (they lead token_ids)


def _delta(req: Request, token_ids, logprobs, error="", **spec) -> RequestDelta:
    """req's delta with these new tokens; a finished request's carries its finish reason."""
    return RequestDelta(
        req.req_id, token_ids, logprobs, req.finish_reason, req.stop_reason,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(0, req.num_cached_tokens),
        cached_tokens_by_tier=req.cached_tokens_by_tier, error=error,
        queue_s=max(0.0, req.scheduled_time - req.arrival_time) if req.scheduled_time else 0.0,
        **spec)


def _append(req: Request, out: _Sampled, max_model_len: int,
            grammar: Grammars) -> tuple[int, Stop | None]:
    """Append a step's tokens to req in order; a stop (EOS, stop token, length, the grammar)
    on one of them ends the request there and drops the rest. (tokens kept, stop)"""
    num, stop = 0, None
    while num < len(out.token_ids) and stop is None:
        index = req.add_token(out.token_ids[num])  # a placeholder's, or a new one
        num += 1
        stop = req.check_stop(max_model_len, index) or _grammar_stop(grammar, req)
    req.record_drafts(out.num_proposed, min(out.num_accepted, num))
    return num, stop


def _idle(grammar: Grammars) -> None:
    """Nothing to run: while only grammars compile, do not spin the step thread."""
    if grammar.num_waiting:
        time.sleep(0.001)


def _token_delta(req: Request, out: _Sampled, num: int) -> RequestDelta:
    """The delta of the first num of a step's tokens (those before a stop)."""
    num_accepted = min(out.num_accepted, num)
    rejected = req.finish_reason == FinishReason.ERROR
    return _delta(req, out.token_ids[:num], [lp for lp in out.logprobs[:num] if lp],
                  error="the grammar rejected a token" if rejected else "",
                  num_draft_proposed=out.num_proposed, num_draft_accepted=num_accepted,
                  accepted_draft_mask=[i < num_accepted for i in range(num)]
                  if out.num_proposed else [])


def _load_model(dtype: torch.dtype, quant: str, path: str):
    """A draft model, in the target's precision (dtype, quant)."""
    loaded = load(resolve_model_path(path), dtype, progress=False, quant=quant)
    return build_model(loaded.args, loaded.state_dict)


def _grammar_stop(grammar: Grammars, req: Request) -> Stop | None:
    """A constrained request ends when its grammar is complete (a stop token, or a
    grammar that allows nothing more); a token it rejects ends it with an error."""
    if not grammar.has(req):
        return None
    if not grammar.sync(req):
        return Stop(FinishReason.ERROR)
    if grammar.is_terminated(req):
        return Stop(FinishReason.STOP)
    return None


def _needs_host_tokens(requests) -> bool:
    """Whether a request needs its token ids on the host before its next draw (penalties
    count them, a grammar walks them): overlapped scheduling then waits for each step."""
    return any(req.params.has_penalties or req.params.constraint is not None
               for req in requests)


def _count_step(counters: dict[str, int]) -> None:
    if counters["steps"] == 0:
        memory.trim_heap()  # the first forward packed every weight: free what it unpacked
        memory.keep_heap()  # from now on a step's freed buffers stay for the next step
    counters["steps"] += 1


def _advance(sched: SchedulerOutput, counters: dict) -> None:
    """The step computes its tokens' KV: each request's counter moves past them."""
    for req, num_new in sched.scheduled:
        req.advance(num_new)
        counters["computed"] += min(num_new, max(0, req.num_prompt_tokens -
                                                 (req.num_computed_tokens - num_new)))


# A step's token budget when max_num_batched_tokens is 0 (auto). On the CPU the prompt
# kernels reach their rate well below 256 rows, and every prompt token in a step delays the
# running streams' next token: on a 2-core Zen 1, 1B Q4_K_M, 32 prompts at concurrency 16,
# 512 -> 256 took the median time to first token from 24.0 to 16.5 s and the slowest
# inter-token gap from 10.4 to 5.6 s at the same output rate (docs/BENCHMARKS.md).
AUTO_BATCHED_TOKENS = {"cpu": 256, "cuda": 512}


def resolve_batched_tokens(config: EngineConfig, platform: Platform) -> int:
    """The step's token budget: max_num_batched_tokens, or auto's for the platform."""
    tokens = config.scheduler.max_num_batched_tokens
    return tokens or AUTO_BATCHED_TOKENS["cuda" if platform.is_cuda else "cpu"]


def resolve_overlap(config: EngineConfig, platform: Platform) -> bool:
    """Overlapped scheduling from config.overlap: auto is on on a GPU (the host's work for
    the next step hides behind the device's for this one) and off on the CPU, where the
    forward runs on the host's own cores and only the wasted rows (a request that stopped
    on a token still in flight computes one more) would change; never with speculation or
    expert parallelism, whose next steps start from this one's tokens or schedule."""
    if config.spec.is_on or config.ep.is_on:
        return False
    return config.overlap == "on" or (config.overlap == "auto" and platform.is_cuda)


def uses_hybrid_kv(config: EngineConfig, args) -> bool:
    """Hybrid KV (engine/hybrid_kv.py) for a model with sliding-window layers, unless turned
    off. It stays on by default because it does nothing on a model without such layers; on
    one with them, speculation is refused, not silently switched off: its rollback of
    rejected drafts needs SWA blocks the window has already released."""
    if not config.cache.hybrid_kv or all(w is None for w in args.layer_windows):
        return False
    if config.spec.is_on:
        raise ValueError(f"--hybrid-kv cannot run with --speculation {config.spec.speculation} "
                         "on a model with sliding-window layers (rolling back rejected drafts "
                         "needs KV the window has released): pass --no-hybrid-kv")
    return True


def _check_request(msg: AddRequest, vocab_size: int, max_model_len: int,
                   capacity: int) -> None:
    """Refuse (ValueError) a request that can never run here: bad retention class, empty
    prompt, ids outside the vocabulary, no room left in the context or the KV pool."""
    ids = msg.prompt_token_ids + msg.output_token_ids
    if msg.retention not in retention.CLASSES:
        raise ValueError(f"unknown retention class {msg.retention!r}; expected one of "
                         f"{list(retention.CLASSES)}")
    if not msg.prompt_token_ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is "
                         f"{max_model_len} tokens, and at least one must be left to generate")
    if len(ids) + 1 > capacity:
        raise ValueError(f"the prompt has {len(ids)} tokens but the KV pool holds only "
                         f"{capacity}")


def _moe_stats(model) -> MoEStats | None:
    """Expert load per rank and imbalance for MoE models; None for dense ones."""
    expert_load = getattr(model, "expert_load", None)
    return expert_load().stats() if expert_load is not None else None


def _kv_stats(kv: KVCacheManager, pool: BlockPool, tiers: KVTiers | None,
              block_bytes: int) -> KVStats:
    """The prefix cache: the device pool's figures, then every tier below it."""
    served = {tier: KVTierStats(hit_tokens=float(num)) for tier, num in kv.num_hit_tokens.items()}
    num_cached = len(pool.key_to_block)
    device = KVTierStats(hit_tokens=served[DEVICE].hit_tokens, entries=float(num_cached),
                         bytes=float(num_cached * block_bytes),
                         evictions=float(pool.num_evictions))
    stats = KVStats(queried_tokens=float(kv.num_queried_tokens), blocks_cached=float(num_cached),
                    device=device, host=served[HOST], disk=served[DISK], shared=served[SHARED],
                    hybrid=kv.hybrid_stats())
    return stats if tiers is None else tiers.kv_stats(stats)


def _eos_token_ids(args, model_path: str) -> tuple[int, ...]:
    ids = [] if args.eos_token_id is None else [args.eos_token_id]
    gen_config = Path(model_path) / "generation_config.json"
    if os.path.isdir(model_path) and gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    return tuple(dict.fromkeys(ids))
