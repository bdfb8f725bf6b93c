"""Serving with expert parallelism: N processes, one torch.distributed group, one worker.

`duplex serve --expert-parallel N` starts one ordinary worker process (rank 0, the leader);
its core factory starts ranks 1..N-1 (followers) on this host, or waits for them to join from
other hosts (`duplex worker --ep-rank R --ep-master HOST:PORT`, torch.distributed's TCP
rendezvous). Only the leader talks to the frontend. Every rank builds the same EngineCore and
shards the experts with `engine.expert_parallel.enable_expert_parallel`.

Lockstep: attention, routers and sampling are replicated, so every rank must see the same
batch at every step. The engine is deterministic given the sequence of (add, abort, step)
calls, so the leader replays that sequence to the followers instead of shipping tensors:

  leader                                  follower
  add / abort: applied at once, queued    -
  step: broadcast StepOrder(queued ops) ->  apply the ops
        core.step()                       core.step()          (MoE layers: all_to_all)
        all_gather(digest of the deltas) <-> all_gather(digest)  (divergence = hard error)

StepOrder travels as msgspec bytes over a gloo group (never pickle). What could make ranks
differ is kept out: deadlines are enforced by the worker loop (it aborts, and the abort is
replayed) rather than by each core's clock, and options whose scheduling depends on timing
(KV reads from the SSD tier, which land in their own time; a time budget; a measured
speculation cost) are refused by EngineConfig. The RAM tier is synchronous, so every rank's
copy holds the same blocks and it is allowed. A rank that dies breaks the next collective: the leader's step raises, the
worker reports WorkerError and the supervisor restarts it, with fresh followers (local
followers die with the leader through PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Union

import msgspec
import torch
import torch.distributed as dist

from duplex.engine.config import EngineConfig, WorkerConfig
from duplex.engine.expert_parallel import free_port
from duplex.engine.messages import AbortRequests, AddRequest, RequestDelta, WorkerStats
from duplex.engine.platform import Platform, resolve
from duplex.engine.stats import MoEStats

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0  # every rank loads the model before the first collective
STEP_TIMEOUT_S = 300.0  # longest wait in a collective once serving
# may differ between ranks (the model by path: its weight digest is compared instead)
# not compared between ranks: per host, or (the worker section) the leader's own
_PER_HOST_FIELDS = ("model", "num_threads", "ep_local_ranks", "ep_master",
                    *(f.name for f in dataclasses.fields(WorkerConfig)))


class StepOrder(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Leader -> followers before each step: the core calls made since the last step, in
    order. `stop`: leave the group (no step)."""
    ops: list[Union[AddRequest, AbortRequests]] = []
    stop: bool = False


class RanksDisagree(RuntimeError):
    """The ranks' configurations or step outputs differ: never continue."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepOrder)


# ---------------------------------------------------------------------------- the group
class RankGroup:
    """This process's membership: the default group (the experts' all_to_all, on the
    platform's collective backend: gloo on CPU, NCCL on CUDA) plus a gloo group of its own
    for the orders and digests (host bytes)."""

    def __init__(self, config: EngineConfig, rank: int, platform: Platform | None = None) -> None:
        platform = platform or resolve(config.device)
        host, port = master_address(config)
        if host in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback
        if platform.is_cuda:
            torch.cuda.set_device(platform.device)  # NCCL binds a rank to the current device
        dist.init_process_group(platform.collective_backend,
                                init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=config.ep.expert_parallel,
                                timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        self.rank, self.size = rank, config.ep.expert_parallel
        self.control = dist.new_group(backend="gloo",
                                      timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))

    def broadcast_order(self, order: StepOrder | None) -> StepOrder:
        """Rank 0 sends `order`; every rank returns it."""
        payload = _ENCODER.encode(order) if self.rank == 0 else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0 \
            else torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        return order if self.rank == 0 else _DECODER.decode(data.numpy().tobytes())

    def check_same(self, what: str, digest: bytes) -> None:
        """Raise unless every rank has the same 8-byte `digest`."""
        mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)])
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.control)
        values = [int(p.item()) for p in parts]
        if len(set(values)) != 1:
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise RanksDisagree(f"expert-parallel ranks disagree on {what} (ranks {differ} "
                               "differ from rank 0)")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def master_address(config: EngineConfig) -> tuple[str, int]:
    """--ep-master HOST:PORT, else MASTER_ADDR / MASTER_PORT from the environment."""
    spec = config.ep.ep_master or (f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                                if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
                                else None)
    if spec is None:
        raise ValueError("--expert-parallel needs a rendezvous address: --ep-master HOST:PORT "
                         "or MASTER_ADDR and MASTER_PORT")
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--ep-master wants HOST:PORT, got {spec!r}")
    return host, int(port)


# ---------------------------------------------------------------------------- every rank
def build_rank_core(config: EngineConfig, group: RankGroup):
    """(EngineCore, ExpertParallel) of one rank, its experts sharded; checks that every rank
    runs the same model (by weight digest) and configuration."""
    from duplex.engine.core import EngineCore
    from duplex.engine.expert_parallel import enable_expert_parallel

    core = EngineCore(config, progress=False)
    shared = {f.name: config.get(f.name) for f in EngineConfig.flat_fields()
              if f.name not in _PER_HOST_FIELDS}
    digest = hashlib.blake2b(msgspec.json.encode([shared, core.model_identity]),
                             digest_size=8).digest()
    group.check_same("the model and engine configuration", digest)
    if not hasattr(core.model, "set_expert_backend"):
        raise ValueError(f"--expert-parallel needs a mixture-of-experts model; "
                         f"{core.model_name} has no experts")
    ep = enable_expert_parallel(core.model, num_redundant=config.ep.ep_redundant_experts,
                                interval_steps=config.ep.eplb_interval_steps)
    return core, ep


def _apply(core, ops) -> None:
    for op in ops:
        if isinstance(op, AddRequest):
            core.add_request(op)
        else:
            core.abort_requests(op.req_ids)


def _deltas_digest(deltas: list[RequestDelta]) -> bytes:
    summary = [(d.req_id, d.new_token_ids, d.finish_reason or "") for d in deltas]
    return hashlib.blake2b(msgspec.msgpack.encode(summary), digest_size=8).digest()


def _rank_config(config: EngineConfig) -> EngineConfig:
    """With --num-threads 0, the local ranks share the cores evenly."""
    if config.num_threads:
        return config
    local = config.ep.ep_local_ranks or config.ep.expert_parallel
    return config.replace(num_threads=max(1, (os.cpu_count() or 1) // local))


# ---------------------------------------------------------------------------- rank 0
class LeaderCore:
    """The Core a worker drives (engine.worker.Core) for a whole EP group. It exposes no
    runner or kv (None), so the worker treats the group as one unified worker."""

    def __init__(self, core, ep, group: RankGroup, followers: list[subprocess.Popen]) -> None:
        self._core, self._ep, self._group, self._followers = core, ep, group, followers
        self._ops: list[AddRequest | AbortRequests] = []
        self.model_name = core.model_name
        self.max_model_len = core.max_model_len
        self.block_size = core.block_size
        self.num_kv_blocks = core.num_kv_blocks
        self.model_identity = core.model_identity
        self.kv_layout, self.kv_format = core.kv_layout, core.kv_format
        self.num_threads, self.weights_label = core.num_threads, core.weights_label
        self.vocab_size, self.cost_model = core.vocab_size, core.cost_model
        self.layout = self.runner = self.kv = None
        self._closed = False

    def add_request(self, msg: AddRequest) -> None:
        # the worker loop owns deadlines; every rank gets rank 0's clock for the arrival
        msg = msgspec.structs.replace(msg, deadline=0.0,
                                      arrival_time=msg.arrival_time or time.time())
        self._core.add_request(msg)  # raises (and queues nothing) if the request is invalid
        self._ops.append(msg)

    def abort_requests(self, req_ids: list[str], error: str = "") -> None:
        self._core.abort_requests(req_ids, error)  # followers: no error (not in the digest)
        self._ops.append(AbortRequests(list(req_ids)))

    def has_request(self, req_id: str) -> bool:
        return self._core.has_request(req_id)

    def request_ids(self) -> list[str]:
        return self._core.request_ids()

    def has_unfinished_requests(self) -> bool:
        return self._core.has_unfinished_requests()

    def step(self) -> list[RequestDelta]:
        ops, self._ops = self._ops, []
        try:
            self._group.broadcast_order(StepOrder(ops))
            deltas = self._core.step()
            self._group.check_same("the step's tokens", _deltas_digest(deltas))
        except RanksDisagree:
            raise
        except RuntimeError as e:  # gloo / NCCL: a peer died, hung or left
            first_line = str(e).split(". ")[0]
            raise RuntimeError(f"expert-parallel group broke (a rank failed or left): "
                               f"{first_line}") from e
        return deltas

    def stats(self) -> WorkerStats:
        stats = self._core.stats()
        moe = msgspec.structs.replace(
            stats.moe or MoEStats(), ep_ranks=float(self._group.size),
            rebalances=float(self._ep.num_rebalances),
            experts_received_rank0=float(self._ep.num_experts_received))
        return msgspec.structs.replace(stats, moe=moe)

    def close(self) -> None:
        """Tell the followers to leave, then leave. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._group.broadcast_order(StepOrder(stop=True))
        except RuntimeError as e:  # a follower is already gone
            log.warning("expert-parallel group: could not stop the followers: %s", e)
        for process in self._followers:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        self._core.close()
        self._group.close()


def leader_core(config: EngineConfig) -> LeaderCore:
    """Core factory of rank 0: start the local followers, form the group, build the core."""
    if config.ep.ep_master is None and "MASTER_ADDR" not in os.environ:
        config = config.replace(ep_master=f"127.0.0.1:{free_port()}")
    config = _rank_config(config)
    local = config.ep.ep_local_ranks or config.ep.expert_parallel
    followers = [_start_follower(config, rank) for rank in range(1, local)]
    try:
        group = RankGroup(config, 0)
        core, ep = build_rank_core(config, group)
    except BaseException:
        for process in followers:
            process.kill()
        raise
    log.info("expert-parallel group ready: %d ranks (%d on this host), master %s",
             config.ep.expert_parallel, local, config.ep.ep_master)
    return LeaderCore(core, ep, group, followers)


def _start_follower(config: EngineConfig, rank: int) -> subprocess.Popen:
    """A local follower in this process group, which dies with this process."""
    return subprocess.Popen(
        [sys.executable, "-m", "duplex.engine.worker_cli", "--ep-rank", str(rank),
         "--config-json", msgspec.json.encode(config).decode(), "--parent-pid", str(os.getpid())],
        env=os.environ.copy())


# ---------------------------------------------------------------------------- ranks 1..N-1
def follow(config: EngineConfig, rank: int, *, started_by_leader: bool = False) -> int:
    """Run rank `rank` until the leader says stop (0) or the group breaks (exception).
    A follower the leader started shares its process group, so it receives the supervisor's
    SIGTERM too: it ignores it and leaves when the leader says stop (or dies with it)."""
    if not 0 < rank < config.ep.expert_parallel:
        raise ValueError(f"--ep-rank must be in [1, {config.ep.expert_parallel}), got {rank}")
    if started_by_leader:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = _rank_config(config)
    group = RankGroup(config, rank)
    core, _ = build_rank_core(config, group)
    log.info("expert-parallel rank %d/%d serving", rank, config.ep.expert_parallel)
    try:
        while True:
            order = group.broadcast_order(None)
            if order.stop:
                return 0
            _apply(core, order.ops)
            group.check_same("the step's tokens", _deltas_digest(core.step()))
    finally:
        core.close()
        group.close()

