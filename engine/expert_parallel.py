"""Expert parallelism (EP): a MoE model's routed experts sharded over the ranks of one
torch.distributed group (gloo on CPU, NCCL on CUDA); everything else is replicated.

Owns, on each rank, the weights of that rank's expert slots, the balancer (placement, load
statistics, staged placement) and the per-rank token counters. Every rank runs the same batch
through the same attention, routers and shared experts, so every rank knows every token's
experts. Per MoE layer (`ExpertParallel.forward`), all on the device, nothing read back
(shapes come from host numbers only, so a decode step can be captured in a CUDA graph):

  1 route     every (token, j) pair gets a slot: the q-th pair of expert e (pair order)
              goes to e's replica q mod replicas(e) under the current placement; the same
              answer on every rank (`route_on_device`, equal to `eplb.route` from zero load).
  2 dispatch  rank r owns the tokens [bounds[r], bounds[r+1]) of the batch and sends each of
              its pairs' hidden rows to the rank holding the pair's slot, through one
              fixed-capacity all_to_all_single: block d of the send buffer, `capacity` rows
              (the most pairs one rank owns), holds the pairs bound for rank d, in pair order,
              then empty rows.
  3 experts   each rank runs its slots' expert MLPs on the rows it received; empty rows have
              no expert (an id past the local slots) and cost nothing in the fused kernels.
  4 combine   results return by the reverse all_to_all_single to the rows they came from,
              are weighted and summed per token in top-k order (`moe.combine`), and
              all_gather rebuilds the whole batch.

Every rank knows every token's slots, so a receiver computes which rows of each source's
block are filled and with which slot (no counts are exchanged): block s holds, in pair
order, the pairs of rank s's tokens whose slot is here. The counters (pairs per expert and
per rank) stay on the device and come to the host once per step, in `end_step`, which the
core calls after sampling.

A token's result depends only on its own rows, whichever rank or replica computed them; under
batch-invariant mode the output is bitwise the single-process output (tests/moe).

Rebalancing (`end_step`, once per step, in lockstep on all ranks): the balancer recomputes
the placement every `interval_steps` steps from the routed-token window (identical on every
rank, so no vote is needed); the weights of every slot that changes are staged (local copies
at once, remote ones by an asynchronous all_to_all_single on a second group, overlapping the
next step); at the end of the next step every rank waits for its copy and all layers switch
to the new placement together. A move never changes a token: replicas hold equal weights.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from duplex.engine.eplb import Balancer, ExpertLoadStats, Placement, moves
from duplex.engine.models.moe import (DEFAULT_STATS_WINDOW, ExpertLoadReport, ExpertWeights,
                               LocalExperts, StepCounts, combine, count_pairs, max_over_mean,
                               run_experts)

DEFAULT_INTERVAL_STEPS = 3000


class _Staged(NamedTuple):
    """A placement whose weights are in flight: committed at the next step boundary."""
    placement: Placement
    work: Any  # the async all_to_all_single of the remote copies
    received: torch.Tensor  # [num_remote_moves, expert_numel]
    received_moves: list  # Move per row of `received`
    weights: dict[int, ExpertWeights]  # moe layer -> this rank's new slot weights


class _Tables(NamedTuple):
    """A placement's routing tables on the device (made again when the placement changes)."""
    placement: Placement
    device: torch.device
    expert_to_slots: torch.Tensor  # [layers, experts, max replicas] (-1 padded)
    replica_count: torch.Tensor  # [layers, experts]
    slot_rank: torch.Tensor  # [slots]

    @classmethod
    def of(cls, placement: Placement, device: torch.device) -> _Tables:
        on = lambda a: torch.from_numpy(np.array(a, dtype=np.int64)).to(device)  # noqa: E731
        return cls(placement, device, on(placement.expert_to_slots),
                   on(placement.replica_count), on(placement.slot_rank))


def occurrence(values: torch.Tensor, num_values: int) -> torch.Tensor:
    """[N]: for each of `values` [N] (ints in [0, num_values)), how many earlier entries hold
    the same value. Device ops only."""
    order = torch.argsort(values, stable=True)  # grouped by value, original order kept
    counts = count_pairs(values, num_values)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(values)
    rank[order] = torch.arange(values.numel(), device=values.device) - starts[values[order]]
    return rank


def route_on_device(topk_ids: torch.Tensor, tables: _Tables, layer: int) -> torch.Tensor:
    """[T * k] slot of each (token, j) pair: the q-th pair of expert e, in pair order, goes
    to e's replica q mod replicas(e). This is `eplb.route` from an all-zero load (water
    filling equal loads deals the picks round-robin, ties to the lowest slot)."""
    ids = topk_ids.reshape(-1).long()
    replica = occurrence(ids, tables.replica_count.shape[1]) % tables.replica_count[layer][ids]
    return tables.expert_to_slots[layer][ids, replica]


class ExpertParallel:
    """Expert backend of one EP rank (see the module docstring). Built by every rank of
    `group` at the same point, from the full single-process experts."""

    def __init__(self, local: LocalExperts, group=None, num_redundant: int = 0,
                 interval_steps: int = DEFAULT_INTERVAL_STEPS, window_steps: int | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.num_experts = local.num_experts
        num_layers = len(local.weights)
        window_steps = window_steps or min(interval_steps, DEFAULT_STATS_WINDOW)
        self.balancer = Balancer(num_layers, self.num_experts, self.num_ranks, num_redundant,
                                 interval_steps, window_steps)
        self.slots = self.placement.rank_slots(self.rank)  # this rank's slot range
        self.weights = [_slot_weights(w, self.placement.slot_to_expert[layer, self.slots])
                        for layer, w in enumerate(local.weights)]
        # tokens computed by each rank, per layer: the "experts" of this counter are ranks
        self.rank_tokens = ExpertLoadStats(num_layers, self.num_ranks,
                                           self.balancer.stats.window_steps)
        self.last_step_rank_tokens = np.zeros((num_layers, self.num_ranks), dtype=np.int64)
        self.expert_counts = StepCounts(num_layers, self.num_experts)  # pairs per expert
        self.rank_counts = StepCounts(num_layers, self.num_ranks)  # pairs each rank computes
        self.counted: torch.Tensor | None = None  # the step's counted rows (ForwardContext)
        self._tables: _Tables | None = None
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self._copy_group = dist.new_group(ranks, backend=dist.get_backend(group))
        self._staged: _Staged | None = None
        self.num_rebalances = 0
        self.num_experts_received = 0  # expert weights copied here from other ranks

    @property
    def placement(self) -> Placement:
        return self.balancer.placement

    # ------------------------------------------------------------------ one MoE layer
    def forward(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, k = topk_ids.shape
        hidden = x.shape[1]
        if num_tokens == 0:
            return torch.zeros_like(x)
        tables = self._device_tables(x.device)
        slot = route_on_device(topk_ids, tables, moe_layer)  # [T * k]
        dest = tables.slot_rank[slot]  # [T * k] rank computing each pair
        self.expert_counts.add(moe_layer, topk_ids, self.counted)
        self.rank_counts.add(moe_layer, dest.view(num_tokens, k), self.counted)
        bounds = token_bounds(num_tokens, self.num_ranks)
        lo, hi = int(bounds[self.rank]), int(bounds[self.rank + 1])
        capacity = int(np.diff(bounds).max()) * k  # host numbers only
        my_dest = dest[lo * k:hi * k]
        my_row = occurrence(my_dest, self.num_ranks)  # row in the destination's block
        send = x.new_zeros(self.num_ranks, capacity, hidden)
        send[my_dest, my_row] = x[lo:hi].repeat_interleave(k, dim=0)
        received = self._exchange(send).view(-1, hidden)  # [ranks * capacity, hidden]
        local_slot = self._received_slots(slot, dest, num_tokens, k, capacity)
        computed = run_experts(received, local_slot, self.weights[moe_layer])
        returned = self._exchange(computed.view(self.num_ranks, capacity, hidden))
        pairs = returned[my_dest, my_row]  # [my tokens * k, hidden], pair order
        mine = combine(pairs.view(hi - lo, k, hidden), topk_weights[lo:hi])
        return self._all_gather(mine, bounds)

    def _received_slots(self, slot: torch.Tensor, dest: torch.Tensor, num_tokens: int, k: int,
                        capacity: int) -> torch.Tensor:
        """[ranks * capacity]: the local slot of each row this rank receives; the number of
        local slots (no expert) for an empty row. Block s holds, in pair order, the pairs of
        rank s's tokens whose slot is here."""
        num_ranks, num_local = self.num_ranks, self.slots.stop - self.slots.start
        token = torch.arange(num_tokens * k, device=slot.device) // k
        source = ((token + 1) * num_ranks - 1) // num_tokens  # rank owning each token
        here = dest == self.rank
        row = occurrence(torch.where(here, source, num_ranks), num_ranks + 1)
        # pairs computed elsewhere all write the same value to one extra row, then dropped
        index = torch.where(here, source * capacity + row, num_ranks * capacity)
        local = torch.full((num_ranks * capacity + 1,), num_local, dtype=torch.long,
                           device=slot.device)
        local[index] = torch.where(here, slot - self.slots.start, num_local)
        return local[:-1]

    def _exchange(self, blocks: torch.Tensor) -> torch.Tensor:
        """[ranks, capacity, hidden]: block d goes to rank d; block s of the result came
        from rank s. Equal splits: no count goes to the host."""
        out = torch.empty_like(blocks)
        dist.all_to_all_single(out, blocks.contiguous(), group=self.group)
        return out

    def _device_tables(self, device: torch.device) -> _Tables:
        tables = self._tables
        if tables is None or tables.placement is not self.placement or tables.device != device:
            tables = self._tables = _Tables.of(self.placement, device)
        return tables

    def _all_gather(self, mine: torch.Tensor, bounds: np.ndarray) -> torch.Tensor:
        """Every rank's token results, in batch order. all_gather needs equal shapes: pad."""
        shares = np.diff(bounds)
        padded = mine.new_zeros(int(shares.max()), mine.shape[1])
        padded[:mine.shape[0]] = mine
        parts = [torch.empty_like(padded) for _ in range(self.num_ranks)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:share] for part, share in zip(parts, shares)])

    # ------------------------------------------------------------------ step boundary
    def end_step(self) -> None:
        """Close the step: the step's counters to the host (one copy), then switch to a
        staged placement, maybe stage a new one."""
        for layer, counts in enumerate(self.expert_counts.take()):
            self.balancer.stats.record(layer, counts)
        self.last_step_rank_tokens = self.rank_counts.take()
        for layer, counts in enumerate(self.last_step_rank_tokens):
            self.rank_tokens.record(layer, counts)
        self.rank_tokens.step()
        if self._staged is not None:
            self._commit()
        plan = self.balancer.on_step()
        if plan is not None:
            self._staged = self._stage(plan)

    def _stage(self, plan: Placement) -> _Staged:
        """Start copying the experts of every slot of this rank that `plan` changes."""
        old = self.placement
        sends, receives = [], []
        staged: dict[int, ExpertWeights] = {}
        for move in moves(old, plan):
            dst = int(plan.slot_rank[move.slot])
            src = _source_rank(old, move.layer, move.expert, dst)
            if dst == self.rank:
                if move.layer not in staged:
                    staged[move.layer] = _clone(self.weights[move.layer])
                weights = staged[move.layer]
                if src == self.rank:  # already here in another slot: copy locally now
                    _put(weights, move.slot - self.slots.start,
                         self._flat_expert(move.layer, move.expert))
                else:
                    receives.append((src, move))
            elif src == self.rank:
                sends.append((dst, move))
        sends.sort(key=lambda item: item[0])  # stable: ties keep move order
        receives.sort(key=lambda item: item[0])
        numel = self.weights[0].w13[0].numel() + self.weights[0].w2[0].numel()
        send = torch.stack([self._flat_expert(m.layer, m.expert) for _, m in sends]) \
            if sends else self.weights[0].w13.new_empty(0, numel)
        received = send.new_empty(len(receives), numel)
        work = dist.all_to_all_single(
            received, send, _counts([r for r, _ in receives], self.num_ranks),
            _counts([d for d, _ in sends], self.num_ranks), group=self._copy_group,
            async_op=True)
        return _Staged(plan, work, received, [m for _, m in receives], staged)

    def _commit(self) -> None:
        staged, self._staged = self._staged, None
        staged.work.wait()
        for move, flat in zip(staged.received_moves, staged.received):
            _put(staged.weights[move.layer], move.slot - self.slots.start, flat)
        self.num_experts_received += len(staged.received_moves)
        for layer, weights in staged.weights.items():
            self.weights[layer] = weights
        assert self.balancer.commit() == staged.placement
        self.num_rebalances += 1

    def _flat_expert(self, layer: int, expert: int) -> torch.Tensor:
        """One expert's weights on this rank (current placement) as one flat row."""
        row = self.placement.slot_to_expert[layer, self.slots]
        local = int(np.flatnonzero(row == expert)[0])
        w = self.weights[layer]
        return torch.cat([w.w13[local].reshape(-1), w.w2[local].reshape(-1)])

    # ------------------------------------------------------------------ reports
    def load_report(self) -> ExpertLoadReport:
        """Routed tokens per expert, and tokens each rank computed, over the window."""
        rank_load = self.rank_tokens.load()
        return ExpertLoadReport(self.balancer.stats.load(), rank_load, max_over_mean(rank_load))


def enable_expert_parallel(model, group=None, num_redundant: int = 0,
                           interval_steps: int = DEFAULT_INTERVAL_STEPS,
                           window_steps: int | None = None) -> ExpertParallel:
    """Shard `model`'s experts over `group` (every rank calls this with the same model).
    The full expert weights are dropped; this rank keeps its slots only."""
    backend = ExpertParallel(model.expert_backend, group, num_redundant, interval_steps,
                             window_steps)
    model.set_expert_backend(backend)
    return backend


def token_bounds(num_tokens: int, num_ranks: int) -> np.ndarray:
    """[num_ranks + 1]: rank r owns tokens [bounds[r], bounds[r+1]) (near-equal shares)."""
    return np.array([num_tokens * r // num_ranks for r in range(num_ranks + 1)])


def _source_rank(old: Placement, layer: int, expert: int, dst: int) -> int:
    """Who sends `expert` to `dst`: dst itself when it already holds it, else the rank of its
    first replica. Every rank computes the same answer."""
    slots = old.expert_to_slots[layer, expert, :old.replica_count[layer, expert]]
    ranks = old.slot_rank[slots]
    return dst if dst in ranks else int(ranks[0])


def _slot_weights(weights: ExpertWeights, experts: np.ndarray) -> ExpertWeights:
    index = torch.from_numpy(np.array(experts, dtype=np.int64))  # a writable copy
    return ExpertWeights(weights.w13[index].clone(), weights.w2[index].clone())


def _clone(weights: ExpertWeights) -> ExpertWeights:
    return ExpertWeights(weights.w13.clone(), weights.w2.clone())


def _put(weights: ExpertWeights, local_slot: int, flat: torch.Tensor) -> None:
    w13_numel = weights.w13[0].numel()
    weights.w13[local_slot].copy_(flat[:w13_numel].view_as(weights.w13[0]))
    weights.w2[local_slot].copy_(flat[w13_numel:].view_as(weights.w2[0]))


def _counts(ranks: list[int], num_ranks: int) -> list[int]:
    return np.bincount(np.array(ranks, dtype=np.int64), minlength=num_ranks).tolist()


# ---------------------------------------------------------------------------- launching
def launch(fn: Callable, num_ranks: int, *args, backend: str = "gloo") -> None:
    """Run `fn(rank, num_ranks, *args)` in `num_ranks` fresh processes that form the default
    process group (tcp://127.0.0.1 on a free port). `fn` must be importable; pass plain
    values and return results through files."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(fn, num_ranks, free_port(), backend, args), nprocs=num_ranks,
             join=True)


def _rank_main(rank: int, fn: Callable, num_ranks: int, port: int, backend: str, args) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=num_ranks)
    try:
        fn(rank, num_ranks, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a local rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------- benchmark
BENCH_MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
                   num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
                   max_position_embeddings=512, initializer_range=0.1)


def build_bench_model(path: str) -> str:
    """A small random Qwen3-MoE checkpoint (16 experts, top-2, 4 layers) at `path`."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**BENCH_MODEL))
    model.save_pretrained(path, safe_serialization=True)
    return path


def skewed_prompts(num_prompts: int, prompt_len: int, band: int = 8) -> list[list[int]]:
    """Prompts of only `band` distinct tokens: similar hidden states, so the routers send
    most tokens to a few experts."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, band, (prompt_len,), generator=gen).tolist()
            for _ in range(num_prompts)]


def _bench_rank(rank: int, num_ranks: int, path: str, out_dir: str, options: dict) -> None:
    """Two identical waves of requests; the placement computed from wave 1's steps is
    switched in during wave 2's first (prefill) step."""
    from duplex.engine.config import EngineConfig
    from duplex.engine.core import EngineCore
    from duplex.engine.messages import AddRequest
    from duplex.engine.sampling_params import SamplingParams

    core = EngineCore(EngineConfig.of(model=path, num_threads=1, enable_prefix_caching=False,
                                   max_num_seqs=options["num_prompts"]), progress=False)
    steps_per_wave = options["max_tokens"]  # one prefill step, then one token per step
    ep = enable_expert_parallel(core.model, num_redundant=options["redundant"],
                                interval_steps=steps_per_wave)
    params = SamplingParams(temperature=0, max_tokens=options["max_tokens"], ignore_eos=True)
    steps = []
    for wave in range(2):
        prompts = skewed_prompts(options["num_prompts"], options["prompt_len"])
        for i, prompt in enumerate(prompts):
            core.add_request(AddRequest(f"w{wave}r{i}", prompt, params))
        first = len(steps)
        while core.has_unfinished_requests():
            placement_id = ep.num_rebalances  # the placement this step's forward uses
            start = time.perf_counter()
            deltas = core.step()
            steps.append(dict(wave=wave, is_prefill=len(steps) == first,
                              seconds=time.perf_counter() - start,
                              tokens=sum(len(d.new_token_ids) for d in deltas),
                              rank_tokens=ep.last_step_rank_tokens.tolist(),
                              placement_id=placement_id))
    if rank == 0:
        with open(os.path.join(out_dir, "steps.json"), "w") as fh:
            json.dump(dict(steps=steps, experts_received=ep.num_experts_received), fh)


def bench(num_ranks: int = 4, redundant: int = 4, num_prompts: int = 16, prompt_len: int = 32,
          max_tokens: int = 64) -> dict:
    """Skewed prompts on `num_ranks` CPU ranks: rank imbalance (max / mean (token, expert)
    pairs per rank, averaged over layers) and tokens/s of the decode steps, wave 1 (initial
    placement) against wave 2 (after the rebalance computed from wave 1)."""
    options = dict(redundant=redundant, num_prompts=num_prompts, prompt_len=prompt_len,
                   max_tokens=max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_bench_model(os.path.join(tmp, "model"))
        launch(_bench_rank, num_ranks, path, tmp, options)
        with open(os.path.join(tmp, "steps.json")) as fh:
            log = json.load(fh)
    decode = [s for s in log["steps"] if not s["is_prefill"]]
    return dict(config=dict(options, num_ranks=num_ranks, model=BENCH_MODEL),
                before=_phase([s for s in decode if s["wave"] == 0]),
                after=_phase([s for s in decode if s["wave"] == 1 and s["placement_id"] > 0]),
                num_rebalances=max(s["placement_id"] for s in log["steps"]),
                experts_received_by_rank0=log["experts_received"])


def _phase(steps: list[dict]) -> dict:
    """Rank imbalance and tokens/s over decode steps."""
    rank_tokens = np.sum([s["rank_tokens"] for s in steps], axis=0)  # [layers, ranks]
    per_layer = max_over_mean(rank_tokens)
    seconds = sum(s["seconds"] for s in steps)
    tokens = sum(s["tokens"] for s in steps)
    return dict(decode_steps=len(steps), imbalance=round(float(per_layer.mean()), 3),
                imbalance_per_layer=[round(float(v), 3) for v in per_layer],
                rank_pairs=rank_tokens.sum(axis=0).tolist(), tokens=tokens,
                seconds=round(seconds, 3), tokens_per_s=round(tokens / seconds, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duplex.engine.expert_parallel",
                                     description="Expert-parallel CPU benchmark (gloo).")
    parser.add_argument("--bench", action="store_true", help="run the skewed-prompt benchmark")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--redundant", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens per request; also the rebalance interval in steps")
    args = parser.parse_args(argv)
    if not args.bench:
        parser.print_help()
        return 2
    result = bench(args.ranks, args.redundant, args.prompts, max_tokens=args.max_tokens)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
