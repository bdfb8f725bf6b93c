"""`duplex bench invariance`: does a request's output depend on what else is in the batch?

Each of 16 target prompts is generated alone, then twice inside a busy engine with random
companions (1-32 others), random arrival times, prefix-cache hits (the second round) and
chunked prefill. Reports how many batched runs differ from the solo run, token or logprob,
in the default mode and with `batch_invariant=True`, and the throughput cost of the mode.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

NUM_TARGETS = 16
NUM_NEW = 64


def random_prompts(seed: int, n: int, shared: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        body = [rng.randrange(200, 20000) for _ in range(rng.randint(4, 60))]
        out.append((shared or []) + body if rng.random() < 0.5 else body)
    return out


def run_jobs(core, jobs) -> dict:
    """jobs: (req_id, prompt, params, arrival step) -> {req_id: (tokens, logprobs)}."""
    from duplex.engine.messages import AddRequest

    out = {rid: ([], []) for rid, *_ in jobs}
    step, last = 0, max(a for *_, a in jobs)
    while step <= last or core.has_unfinished_requests():
        for rid, prompt, params, arrival in jobs:
            if arrival == step:
                core.add_request(AddRequest(rid, prompt, params))
        for d in core.step():
            out[d.req_id][0].extend(d.new_token_ids)
            out[d.req_id][1].extend(lp.logprob for lp in d.logprobs)
        step += 1
    return out


def experiment(make_core, batch_invariant: bool, seed: int = 0, rounds: int = 2,
               num_targets: int = NUM_TARGETS, num_new: int = NUM_NEW,
               max_companions: int = 32) -> dict:
    """Solo vs busy runs of `num_targets` targets of `num_new` tokens each, beside up to
    `max_companions` other requests; `make_core(**engine_kwargs)` builds an engine.
    Returns counts of differing runs plus the solo and busy outputs."""
    from duplex.engine.sampling_params import SamplingParams

    shared = random_prompts(99, 1)[0] * 2  # a prefix some prompts share: prefix-cache hits
    targets = random_prompts(seed, num_targets, shared)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=1000 + i,
                             max_tokens=num_new, ignore_eos=True, logprobs=0)
              for i in range(num_targets)]
    solo_core = make_core(batch_invariant=batch_invariant, enable_prefix_caching=False)
    solo = {f"t{i}": run_jobs(solo_core, [(f"t{i}", p, sp, 0)])[f"t{i}"]
            for i, (p, sp) in enumerate(zip(targets, params))}
    rng = random.Random(seed + 1)
    busy_core = make_core(batch_invariant=batch_invariant, max_num_batched_tokens=48,
                          max_num_seqs=40)
    busy, differing_tokens, differing_any = [], 0, 0
    for rnd in range(rounds):  # the second round hits the prefix cache the first one filled
        jobs = [(f"t{i}", p, sp, rng.randint(0, 12))
                for i, (p, sp) in enumerate(zip(targets, params))]
        companions = random_prompts(seed + 10 + rnd, rng.randint(1, max_companions), shared)
        jobs += [(f"c{rnd}-{j}", p, SamplingParams(temperature=0.7, max_tokens=rng.randint(1, 40),
                                                   ignore_eos=True), rng.randint(0, 20))
                 for j, p in enumerate(companions)]
        got = run_jobs(busy_core, jobs)
        busy.append({k: v for k, v in got.items() if k.startswith("t")})
        differing_tokens += sum(got[k][0] != solo[k][0] for k in solo)
        differing_any += sum(got[k] != solo[k] for k in solo)
    return {"runs": rounds * num_targets, "differing_tokens": differing_tokens,
            "differing_tokens_or_logprobs": differing_any, "solo": solo, "busy": busy}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    from duplex.engine.config import EngineConfig
    from duplex.engine.core import EngineCore

    def make_core(**kwargs):
        return EngineCore(EngineConfig.of(model=args.model, **kwargs), progress=False)

    report = {}
    for mode in (False, True):
        start = time.perf_counter()
        result = experiment(make_core, batch_invariant=mode)
        report["on" if mode else "off"] = {
            "runs": result["runs"], "differing_tokens": result["differing_tokens"],
            "differing_tokens_or_logprobs": result["differing_tokens_or_logprobs"],
            "seconds": time.perf_counter() - start}
    print("| batch-invariant | runs | differ (tokens) | differ (tokens or logprobs) | seconds |")
    print("|---|---|---|---|---|")
    for mode, r in report.items():
        print(f"| {mode} | {r['runs']} | {r['differing_tokens']} | "
              f"{r['differing_tokens_or_logprobs']} | {r['seconds']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0
