"""`duplex plan`: recommend a prefill:decode worker ratio for a workload at target TTFT / TPOT.

    duplex plan --workload trace.jsonl --cost-model prefill.json --cost-model decode.json \\
        --target-ttft-s 2 --target-tpot-s 0.1 [--max-workers 8]
    duplex plan --workload bench_result.json --calibrate [--model PATH]

Inputs
  workload    a JSONL trace like Mooncake's (timestamp ms, input_length, output_length,
              hash_ids: 512-token blocks, equal ids = equal prefixes) or a `duplex bench serve`
              result JSON (its records: send time, prompt / cached / completion tokens)
  cost model  `engine.cost_model` coefficients: JSON saved by a worker (`duplex worker
              --cost-model-out`), its /metrics figures (cost_* names), or `--calibrate`: a short
              run of an in-process engine on the model, fitted the same way. One model serves
              both roles unless two are given (prefill first).

Model of a layout with P prefill and D decode workers
  prefill  each request costs the predicted time of its uncached prompt, in chunks of
           --chunk-tokens; requests arrive at the trace's times (scaled by --rate-scale) and
           queue for the first free prefill worker (simulated): TTFT = wait + compute.
  decode   a worker holding B streams of mean context K steps in t(B) = c_step + c_decode·B
           + c_attend·B·K/1000; Little's law gives B = λ·out·t(B)/D, solved by fixed point;
           TPOT = t(max(B, 1)). No fixed point: the decode side cannot keep up.
The smallest total P + D meeting both targets (p90 TTFT, TPOT) is recommended, then the split
with the most headroom. It is a model: check it with `duplex bench serve`.
"""
from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

from duplex.engine.cost_model import CostModel, StepFeatures, attended_pairs

MOONCAKE_BLOCK_TOKENS = 512


class PlanRequest(NamedTuple):
    arrival_s: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class Layout(NamedTuple):
    num_prefill: int
    num_decode: int
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_s: float  # inf: the decode side cannot keep up
    streams_per_decode: float

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        return self.ttft_p90_s <= ttft_s and self.tpot_s <= tpot_s

    def headroom(self, ttft_s: float, tpot_s: float) -> float:
        return min(ttft_s / max(self.ttft_p90_s, 1e-9), tpot_s / max(self.tpot_s, 1e-9))


# ---------------------------------------------------------------- workloads
def load_workload(path: str, max_requests: int | None = None) -> list[PlanRequest]:
    text = Path(path).read_text()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None  # JSONL
    if isinstance(whole, dict) and "results" in whole:  # `duplex bench disagg`: the first run
        whole = whole["results"][0]
    if isinstance(whole, dict) and "records" in whole:
        requests = _from_bench_result(whole)
    elif whole is not None and text.count("\n") <= 1 and not isinstance(whole, dict):
        raise ValueError(f"{path}: not a trace (JSONL) nor a bench result")
    else:
        requests = _from_trace(text.splitlines())
    if not requests:
        raise ValueError(f"{path}: no requests found")
    return requests[:max_requests] if max_requests else requests


def _from_trace(lines: list[str]) -> list[PlanRequest]:
    """Mooncake-style JSONL; cached tokens = the leading hash ids already seen."""
    seen: set[int] = set()
    requests = []
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        hash_ids = row.get("hash_ids", [])
        num_hit = 0
        for hash_id in hash_ids:
            if hash_id not in seen:
                break
            num_hit += 1
        seen.update(hash_ids)
        prompt = int(row["input_length"])
        cached = min(num_hit * MOONCAKE_BLOCK_TOKENS, max(0, prompt - 1))
        requests.append(PlanRequest(float(row.get("timestamp", 0)) / 1000.0, prompt, cached,
                                    max(1, int(row["output_length"]))))
    return requests


def _from_bench_result(result: dict) -> list[PlanRequest]:
    requests = []
    for record in result["records"]:
        if record.get("status") != "ok" or not record.get("prompt_tokens"):
            continue
        requests.append(PlanRequest(float(record["send_s"]), int(record["prompt_tokens"]),
                                    int(record.get("cached_tokens") or 0),
                                    max(1, int(record.get("completion_tokens") or 1))))
    return sorted(requests)


# ---------------------------------------------------------------- the model of a layout
def prefill_seconds(model: CostModel, num_tokens: int, num_cached: int, chunk: int) -> float:
    """Predicted compute time of a prompt's uncached part, chunk by chunk."""
    seconds, done = 0.0, num_cached
    while done < num_tokens:
        n = min(chunk, num_tokens - done)
        seconds += model.predict(StepFeatures(n, attended_pairs(done, n) / 1000.0, 0))
        done += n
    return seconds


def simulate_ttft(requests: list[PlanRequest], service_s: list[float],
                  num_workers: int) -> list[float]:
    """FIFO to the first free of num_workers prefill workers: wait + compute, per request."""
    free_at = [0.0] * num_workers
    ttft = []
    for req, service in sorted(zip(requests, service_s)):
        start = max(req.arrival_s, heapq.heappop(free_at))
        heapq.heappush(free_at, start + service)
        ttft.append(start + service - req.arrival_s)
    return ttft


def decode_tpot(model: CostModel, rate: float, mean_output: float, mean_context: float,
                num_decode: int) -> tuple[float, float]:
    """(TPOT, streams per worker) at the fixed point B = rate·out·t(B)/D; (inf, inf) when
    the step time grows faster than the streams drain."""
    c_attend, c_decode, c_step = model.coef[1], model.coef[2], model.coef[3]
    per_stream = c_decode + c_attend * mean_context / 1000.0
    demand = rate * mean_output / num_decode  # stream-seconds per second, per token time
    if demand * per_stream >= 1.0:
        return float("inf"), float("inf")
    streams = demand * c_step / (1.0 - demand * per_stream)
    return c_step + per_stream * max(streams, 1.0), streams  # a stream steps with itself


def evaluate(requests: list[PlanRequest], prefill: CostModel, decode: CostModel,
             num_prefill: int, num_decode: int, chunk: int) -> Layout:
    service = [prefill_seconds(prefill, r.num_prompt_tokens, r.num_cached_tokens, chunk)
               for r in requests]
    ttft = sorted(simulate_ttft(requests, service, num_prefill))
    span = max(requests[-1].arrival_s - requests[0].arrival_s, 1e-9)
    rate = len(requests) / span if len(requests) > 1 else 1.0
    mean_output = statistics.fmean(r.num_output_tokens for r in requests)
    mean_context = statistics.fmean(r.num_prompt_tokens + r.num_output_tokens / 2
                                    for r in requests)
    tpot, streams = decode_tpot(decode, rate, mean_output, mean_context, num_decode)
    return Layout(num_prefill, num_decode, _quantile(ttft, 0.5), _quantile(ttft, 0.9), tpot,
                  streams)


def plan(requests: list[PlanRequest], prefill: CostModel, decode: CostModel, *,
         ttft_s: float, tpot_s: float, max_workers: int, chunk: int) -> tuple[Layout | None,
                                                                               list[Layout]]:
    """Every split of 2..max_workers workers, and the recommended one (None: none meets)."""
    layouts = [evaluate(requests, prefill, decode, p, total - p, chunk)
               for total in range(2, max_workers + 1) for p in range(1, total)]
    for total in range(2, max_workers + 1):
        fits = [lay for lay in layouts if lay.num_prefill + lay.num_decode == total
                and lay.meets(ttft_s, tpot_s)]
        if fits:
            return max(fits, key=lambda lay: lay.headroom(ttft_s, tpot_s)), layouts
    return None, layouts


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# ---------------------------------------------------------------- cost models
def load_cost_model(path: str) -> CostModel:
    """A worker's saved model (`CostModel.to_dict`), or its /metrics figures (cost_* names),
    optionally under a "cost_model" key."""
    data = json.loads(Path(path).read_text())
    return CostModel.from_dict(data.get("cost_model", data))


def calibrate(model_path: str | None, num_threads: int = 0, max_tokens: int = 256) -> CostModel:
    """Fit a cost model on a short in-process run: prompts of several lengths (chunked
    prefill, prefix hits) and decode batches of several sizes."""
    from duplex.engine.config import EngineConfig
    from duplex.engine.core import EngineCore
    from duplex.engine.messages import AddRequest
    from duplex.engine.sampling_params import SamplingParams

    config = EngineConfig.of(model=model_path, max_num_batched_tokens=max_tokens,
                          num_threads=num_threads, max_model_len=4096)
    core = EngineCore(config, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    vocab = core.args.vocab_size
    lengths = [16, 48, max_tokens // 2, max_tokens, 2 * max_tokens, 3 * max_tokens]
    for batch in (1, 4, 8):
        for i, length in enumerate(lengths[:4] if batch > 1 else lengths):
            for b in range(batch):
                prompt = [(7 * j + 13 * b + 101 * i + batch) % (vocab - 1) + 1
                          for j in range(min(length, core.max_model_len - 16))]
                core.add_request(AddRequest(f"cal-{batch}-{i}-{b}", prompt, params))
            while core.has_unfinished_requests():
                core.step()
    return core.cost_model


# ---------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, metavar="FILE",
                        help="Mooncake-style JSONL trace or a `duplex bench serve` result JSON")
    parser.add_argument("--cost-model", action="append", default=[], metavar="JSON",
                        help="cost model of a worker (repeat: prefill first, then decode)")
    parser.add_argument("--calibrate", action="store_true",
                        help="fit a cost model with a short in-process run instead")
    parser.add_argument("--model", default=None, help="model for --calibrate (default model)")
    parser.add_argument("--num-threads", type=int, default=0, help="threads for --calibrate")
    parser.add_argument("--save-cost-model", default=None, metavar="JSON",
                        help="write the calibrated cost model here")
    parser.add_argument("--target-ttft-s", type=float, default=2.0, help="p90 TTFT target")
    parser.add_argument("--target-tpot-s", type=float, default=0.1, help="TPOT target")
    parser.add_argument("--max-workers", type=int, default=8, help="largest P + D considered")
    parser.add_argument("--chunk-tokens", type=int, default=512,
                        help="prefill chunk (max_num_batched_tokens, or what the step budget "
                             "allows)")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="multiply the arrival rate (compress the trace's time)")
    parser.add_argument("--max-requests", type=int, default=None, help="first N requests only")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        requests = load_workload(args.workload, args.max_requests)
        models = _cost_models(args)
    except (OSError, ValueError, KeyError) as e:
        print(f"duplex plan: {e}", file=sys.stderr)
        return 2
    if args.rate_scale != 1.0:
        requests = [r._replace(arrival_s=r.arrival_s / args.rate_scale) for r in requests]
    best, layouts = plan(requests, models[0], models[-1], ttft_s=args.target_ttft_s,
                         tpot_s=args.target_tpot_s, max_workers=args.max_workers,
                         chunk=args.chunk_tokens)
    if args.json:
        print(json.dumps({"recommended": best._asdict() if best else None,
                          "layouts": [lay._asdict() for lay in layouts]}, default=str))
    else:
        print(_report(requests, best, layouts, args))
    return 0 if best is not None else 1


def _cost_models(args: argparse.Namespace) -> list[CostModel]:
    if args.calibrate:
        model = calibrate(args.model, args.num_threads)
        if args.save_cost_model:
            Path(args.save_cost_model).write_text(json.dumps(model.to_dict(), indent=1))
        return [model]
    if not args.cost_model:
        raise ValueError("give --cost-model JSON (saved by a worker) or --calibrate")
    return [load_cost_model(path) for path in args.cost_model[:2]]


def _report(requests: list[PlanRequest], best: Layout | None, layouts: list[Layout],
            args: argparse.Namespace) -> str:
    lines = [f"workload: {len(requests)} requests, mean prompt "
             f"{statistics.fmean(r.num_prompt_tokens for r in requests):.0f} tokens "
             f"(cached {statistics.fmean(r.num_cached_tokens for r in requests):.0f}), mean "
             f"output {statistics.fmean(r.num_output_tokens for r in requests):.0f}",
             f"targets: p90 TTFT <= {args.target_ttft_s:g} s, TPOT <= {args.target_tpot_s:g} s",
             "", "  P  D   TTFT p50   TTFT p90       TPOT  streams/D", ]
    for lay in layouts:
        mark = " <-" if lay == best else ""
        lines.append(f"{lay.num_prefill:3d}{lay.num_decode:3d} {lay.ttft_p50_s:10.3f} "
                     f"{lay.ttft_p90_s:10.3f} {lay.tpot_s:10.4f} {lay.streams_per_decode:10.1f}"
                     f"{mark}")
    lines.append("")
    lines.append(f"recommended: {best.num_prefill} prefill : {best.num_decode} decode"
                 if best else f"no layout up to {args.max_workers} workers meets the targets")
    return "\n".join(lines)
