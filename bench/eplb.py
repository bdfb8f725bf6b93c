"""`duplex bench eplb`: replay expert-routing statistics through the EPLB balancer.

Owns the routing workloads (Zipf, drifting hotspot, recorded file) and the simulation loop; the
balancing itself is `engine.eplb`. Per step it records token counts per expert, measures the
max/mean rank load of the identity placement (no replicas) and of the balanced placement in
service, and switches placements when the balancer plans one (the weight copy is assumed to
finish within the step). Reports a summary, the bytes moved per rebalance and a timeline, as
Markdown; `--out` writes JSON, `--plot` a PNG.

Synthetic routing: each token picks `top_k` distinct experts, expert popularity falling as
1 / rank**s (Plackett-Luce sampling without replacement). The marginal selection probability of
each expert is estimated once by Monte Carlo; per step the counts are one multinomial draw of
`tokens_per_step * top_k` selections. Which expert ids are hot is a random permutation per
layer; in the drift workload the hot window slides along that permutation by one expert every
`drift_period` steps (linearly blended in between), so the hot set rotates over time.

Two imbalance figures are kept apart: "expected" uses the workload's true selection
probabilities (what a placement can fix); "sampled" uses one step's counts, adding the
multinomial noise of a finite batch, which no placement can remove.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from duplex.engine.eplb import Balancer, identity_placement, imbalance, moved_bytes, moves

# DeepSeek-V3 routed expert: gate, up and down projections of 7168 x 2048, fp8 (1 byte each).
DEEPSEEK_V3_EXPERT_BYTES = 3 * 7168 * 2048


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=("zipf", "drift", "file"), default="zipf",
                   help="routing model: static Zipf, drifting hotspot, or a recorded file")
    w.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent s (default 1.0)")
    w.add_argument("--drift-period", type=float, default=200.0,
                   help="drift: steps for the hot window to advance one expert (default 200)")
    w.add_argument("--trace", type=Path, default=None,
                   help="file: .npy or .json counts [steps, layers, experts]")
    w.add_argument("--experts", type=int, default=256)
    w.add_argument("--top-k", type=int, default=8, help="experts per token (default 8)")
    w.add_argument("--layers", type=int, default=4, help="MoE layers (default 4)")
    w.add_argument("--tokens-per-step", type=int, default=4096)
    w.add_argument("--steps", type=int, default=3000)
    w.add_argument("--seed", type=int, default=0)
    b = parser.add_argument_group("balancer")
    b.add_argument("--ranks", type=int, default=64, help="expert-parallel ranks (default 64)")
    b.add_argument("--redundant", type=int, default=32, help="redundant slots (default 32)")
    b.add_argument("--interval", type=int, default=500,
                   help="steps between rebalances (default 500)")
    b.add_argument("--window", type=int, default=None,
                   help="steps of statistics a placement is computed from (default: interval)")
    b.add_argument("--move-tolerance", type=float, default=0.01,
                   help="keep more weights in place if within this relative peak (default 0.01)")
    b.add_argument("--bytes-per-expert", type=int, default=DEEPSEEK_V3_EXPERT_BYTES,
                   help="weight bytes of one expert (default: DeepSeek-V3, 3x7168x2048 fp8)")
    o = parser.add_argument_group("output")
    o.add_argument("--table-every", type=int, default=None,
                   help="steps per timeline row (default: interval / 4)")
    o.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    o.add_argument("--plot", type=Path, default=None, help="write a PNG of the timeline")


def run(args: argparse.Namespace) -> int:
    try:
        workload = make_workload(args)
        result = simulate(workload, args.ranks, args.redundant, args.interval,
                          args.window, args.bytes_per_expert, args.move_tolerance,
                          args.table_every or max(1, args.interval // 4))
    except (ValueError, OSError) as e:
        print(f"duplex bench eplb: {e}", file=sys.stderr)
        return 2
    print(to_markdown(result))
    if args.out:
        args.out.write_text(json.dumps(dataclasses.asdict(result), indent=2))
    if args.plot:
        plot(result, args.plot)
    return 0


# --- workloads -------------------------------------------------------------------------------

class SyntheticWorkload:
    """Zipf routing per layer; `drift_period` None keeps the hot set still."""

    def __init__(self, num_layers, num_experts, top_k, tokens_per_step, num_steps, s,
                 drift_period, seed):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}]")
        self.name = f"zipf(s={s:g})" if drift_period is None else \
            f"drift(s={s:g}, period={drift_period:g})"
        self.num_layers, self.num_experts, self.num_steps = num_layers, num_experts, num_steps
        self.num_selections = tokens_per_step * top_k
        self.drift_period = drift_period
        self.rng = np.random.default_rng(seed)
        self.by_rank = selection_probabilities(s, num_experts, top_k, self.rng) / top_k
        self.perms = np.stack([self.rng.permutation(num_experts) for _ in range(num_layers)])

    def expected(self, step: int) -> np.ndarray:
        """[num_layers, num_experts]: selection probabilities (sum 1 per layer) at `step`."""
        offset = 0.0 if self.drift_period is None else step / self.drift_period
        whole, frac = int(offset), offset - int(offset)
        return (1 - frac) * self._rotated(whole) + frac * self._rotated(whole + 1)

    def counts(self, step: int) -> np.ndarray:
        return self.rng.multinomial(self.num_selections, self.expected(step))

    def _rotated(self, offset: int) -> np.ndarray:
        probs = np.empty((self.num_layers, self.num_experts))
        for layer, perm in enumerate(self.perms):
            probs[layer, np.roll(perm, -offset)] = self.by_rank
        return probs


class RecordedWorkload:
    """Counts [steps, layers, experts] from a .npy or .json file (JSON: a nested list, or an
    object with a "counts" field)."""

    def __init__(self, path: Path):
        if path.suffix == ".npy":
            data = np.load(path)
        else:
            raw = json.loads(path.read_text())
            data = np.asarray(raw["counts"] if isinstance(raw, dict) else raw)
        if data.ndim != 3 or data.size == 0 or np.any(data < 0):
            raise ValueError(f"{path}: need non-negative counts [steps, layers, experts], "
                             f"got shape {data.shape}")
        self.name = f"file({path.name})"
        self.data = data.astype(np.int64)
        self.num_steps, self.num_layers, self.num_experts = self.data.shape

    def expected(self, step: int) -> None:
        return None

    def counts(self, step: int) -> np.ndarray:
        return self.data[step]


def make_workload(args):
    if args.workload == "file" or args.trace is not None:
        if args.trace is None:
            raise ValueError("--workload file needs --trace PATH")
        return RecordedWorkload(args.trace)
    drift = args.drift_period if args.workload == "drift" else None
    return SyntheticWorkload(args.layers, args.experts, args.top_k, args.tokens_per_step,
                             args.steps, args.zipf_s, drift, args.seed)


def selection_probabilities(s: float, num_experts: int, top_k: int, rng,
                            num_tokens: int = 20000) -> np.ndarray:
    """[num_experts]: probability that a token's top_k (distinct) experts include the expert of
    popularity rank i, weights 1 / (i+1)**s; Monte Carlo with Gumbel top-k. Sums to top_k."""
    if top_k == num_experts:
        return np.ones(num_experts)
    log_weights = -s * np.log(np.arange(1, num_experts + 1))
    chosen = np.zeros(num_experts)
    for start in range(0, num_tokens, 2000):
        keys = log_weights + rng.gumbel(size=(min(2000, num_tokens - start), num_experts))
        top = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]  # [tokens, top_k]
        chosen += np.bincount(top.ravel(), minlength=num_experts)
    return chosen / num_tokens


# --- simulation ------------------------------------------------------------------------------

@dataclasses.dataclass
class Rebalance:
    step: int
    num_moves: int
    bytes_moved: int
    window_identity: float   # max/mean on the window load, mean over layers
    window_before: float     # the placement in service until now
    window_after: float      # the new placement


@dataclasses.dataclass
class TimelineRow:
    first_step: int
    last_step: int
    sampled_identity: float
    sampled_balanced: float
    expected_identity: float | None
    expected_balanced: float | None
    num_rebalances: int
    bytes_moved: int


@dataclasses.dataclass
class Result:
    config: dict
    summary: dict
    rebalances: list[Rebalance]
    timeline: list[TimelineRow]


def simulate(workload, num_ranks, num_redundant, interval, window, bytes_per_expert,
             move_tolerance, table_every) -> Result:
    """Run every step of `workload` through a Balancer; commit plans immediately."""
    balancer = Balancer(workload.num_layers, workload.num_experts, num_ranks, num_redundant,
                        interval, window, move_tolerance=move_tolerance)
    identity = identity_placement(workload.num_layers, workload.num_experts, num_ranks)
    series = {key: [] for key in ("sampled_identity", "sampled_balanced",
                                  "expected_identity", "expected_balanced")}
    rebalances = []
    for step in range(workload.num_steps):
        counts = workload.counts(step)
        expected = workload.expected(step)
        _measure(series, counts, expected, balancer.placement, identity)
        for layer, row in enumerate(counts):
            balancer.stats.record(layer, row)
        if balancer.on_step() is not None:
            rebalances.append(_rebalance(balancer, identity, step, bytes_per_expert))
            balancer.commit()
    config = dict(workload=workload.name, num_layers=workload.num_layers,
                  num_experts=workload.num_experts, num_ranks=num_ranks,
                  num_redundant=num_redundant, slots_per_rank=sorted(set(
                      balancer.placement.slots_per_rank)), interval_steps=interval,
                  window_steps=balancer.stats.window_steps, num_steps=workload.num_steps,
                  bytes_per_expert=bytes_per_expert, move_tolerance=move_tolerance)
    return Result(config, _summary(series, rebalances, interval),
                  rebalances, _timeline(series, rebalances, table_every))


def _measure(series, counts, expected, placement, identity) -> None:
    series["sampled_identity"].append(imbalance(counts, identity).mean())
    series["sampled_balanced"].append(imbalance(counts, placement).mean())
    if expected is not None:
        series["expected_identity"].append(imbalance(expected, identity).mean())
        series["expected_balanced"].append(imbalance(expected, placement).mean())


def _rebalance(balancer, identity, step, bytes_per_expert) -> Rebalance:
    plan, current, stats = balancer.pending, balancer.placement, balancer.stats
    return Rebalance(step=step + 1, num_moves=len(moves(current, plan)),
                     bytes_moved=moved_bytes(current, plan, bytes_per_expert),
                     window_identity=float(stats.imbalance(identity).mean()),
                     window_before=float(stats.imbalance(current).mean()),
                     window_after=float(stats.imbalance(plan).mean()))


def _summary(series, rebalances, interval) -> dict:
    """Figures after the first rebalance (before it the placement knows no statistics)."""
    settled = slice(interval, None)
    out = {key: _mean(values[settled]) for key, values in series.items()}
    out.update(
        num_rebalances=len(rebalances),
        window_identity=_mean([r.window_identity for r in rebalances]),
        window_balanced=_mean([r.window_after for r in rebalances]),
        mean_bytes_per_rebalance=_mean([r.bytes_moved for r in rebalances[1:]]),
        max_bytes_per_rebalance=max((r.bytes_moved for r in rebalances[1:]), default=None),
        first_rebalance_bytes=rebalances[0].bytes_moved if rebalances else None)
    return out


def _timeline(series, rebalances, every) -> list[TimelineRow]:
    rows = []
    num_steps = len(series["sampled_identity"])
    for first in range(0, num_steps, every):
        last = min(first + every, num_steps) - 1
        inside = [r for r in rebalances if first < r.step <= last + 1]
        span = slice(first, last + 1)
        rows.append(TimelineRow(
            first, last, _mean(series["sampled_identity"][span]),
            _mean(series["sampled_balanced"][span]),
            _mean(series["expected_identity"][span]), _mean(series["expected_balanced"][span]),
            len(inside), sum(r.bytes_moved for r in inside)))
    return rows


def _mean(values) -> float | None:
    return float(np.mean(values)) if len(values) else None


# --- reporting -------------------------------------------------------------------------------

def to_markdown(result: Result) -> str:
    c, s = result.config, result.summary
    lines = [f"## EPLB simulation: {c['workload']}, {c['num_ranks']} ranks x "
             f"{c['num_experts']} experts + {c['num_redundant']} redundant slots "
             f"({'/'.join(map(str, c['slots_per_rank']))} per rank), {c['num_layers']} layers, "
             f"rebalance every {c['interval_steps']} steps on a {c['window_steps']}-step window",
             "", "max/mean rank load, mean over layers (after the first rebalance):", "",
             "| load measured on | identity (no replicas) | balanced |", "|---|---|---|",
             f"| window the placement was computed from | {_fmt(s['window_identity'])} | "
             f"{_fmt(s['window_balanced'])} |"]
    if s["expected_identity"] is not None:
        lines.append(f"| expected load (noise-free) | {_fmt(s['expected_identity'])} | "
                     f"{_fmt(s['expected_balanced'])} |")
    lines += [f"| one step's counts (with batch noise) | {_fmt(s['sampled_identity'])} | "
              f"{_fmt(s['sampled_balanced'])} |", "",
              f"rebalances: {s['num_rebalances']}; bytes moved: first "
              f"{_gb(s['first_rebalance_bytes'])} (from the initial placement), then mean "
              f"{_gb(s['mean_bytes_per_rebalance'])} / max {_gb(s['max_bytes_per_rebalance'])} "
              f"per rebalance ({c['bytes_per_expert'] / 1e6:.1f} MB per expert)", "",
              "| steps | identity (sampled) | balanced (sampled) | identity (expected) "
              "| balanced (expected) | rebalances | moved |", "|---|---|---|---|---|---|---|"]
    for row in result.timeline:
        lines.append(f"| {row.first_step}-{row.last_step} | {_fmt(row.sampled_identity)} | "
                     f"{_fmt(row.sampled_balanced)} | {_fmt(row.expected_identity)} | "
                     f"{_fmt(row.expected_balanced)} | {row.num_rebalances or ''} | "
                     f"{_gb(row.bytes_moved) if row.num_rebalances else ''} |")
    return "\n".join(lines)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _gb(num_bytes) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 1e9:.2f} GB"


def plot(result: Result, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.timeline
    x = [(row.first_step + row.last_step) / 2 for row in rows]
    fig, ax = plt.subplots(figsize=(9, 4))
    for field, label, style in (("sampled_identity", "identity, sampled", "C0--"),
                                ("sampled_balanced", "balanced, sampled", "C1-"),
                                ("expected_identity", "identity, expected", "C0:"),
                                ("expected_balanced", "balanced, expected", "C1:")):
        values = [getattr(row, field) for row in rows]
        if all(v is not None for v in values):
            ax.plot(x, values, style, label=label)
    for rebalance in result.rebalances:
        ax.axvline(rebalance.step, color="grey", lw=0.5)
    ax.set_yscale("log")
    ax.set_xlabel("step (grey: rebalance)")
    ax.set_ylabel("max / mean rank load")
    ax.set_title(result.config["workload"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
