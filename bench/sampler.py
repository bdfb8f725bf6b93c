"""`duplex bench sampler`: the batched sampler alone, on a real model's logits.

Logits come from the model itself: `--batch` requests of random-token prompts decode a few
steps at temperature 1, and the logits the sampler saw are kept (`--logits-out FILE` saves
them, `--logits FILE` reuses them, so another build's sampler can be timed on the very same
rows). Then `Sampler.__call__` is timed on batches of those rows for several parameter sets
(median and best of `--repeats`), beside the torch reference of the same semantics
(kernels/cpu_sampler.sample_ref, what a device without the C kernel runs).

Greedy benchmarks never show the sampler; a language model's top_p 0.95 nucleus is
hundreds to thousands of tokens wide, which is where a per-row sort costs.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from duplex.bench.report import write_json

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "top_p 0.95": dict(temperature=1.0, top_p=0.95),
    "top_p 0.95, temperature 0.7": dict(temperature=0.7, top_p=0.95),
    "top_k 50": dict(temperature=1.0, top_k=50),
    "top_k 50, top_p 0.9, min_p 0.05": dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05),
    "top_p 0.95, seeded": dict(temperature=1.0, top_p=0.95, seed=1),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2 GGUF)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--logits", default=None, help="reuse logits saved by --logits-out")
    parser.add_argument("--logits-out", default=None)
    parser.add_argument("--skip-ref", action="store_true", help="do not time the reference")
    parser.add_argument("--out", default=None, help="write the JSON result here")


def capture_logits(model: str | None, batch: int, steps: int = 8):
    """[batch * steps, vocab] fp32 logits the sampler saw while `batch` requests decoded."""
    import torch

    from duplex.engine.llm import LLM
    from duplex.engine.sampling_params import SamplingParams

    llm = LLM(model, max_num_seqs=batch, progress=False, tokenizer=False)
    seen: list = []
    sampler = llm.engine.sampler

    class Spy:
        def __getattr__(self, name):
            return getattr(sampler, name)

        def __call__(self, logits, reqs, mask=None):
            if logits.shape[0] == batch:
                seen.append(logits.clone())
            return sampler(logits, reqs, mask)

    llm.engine.sampler = Spy()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(48)] for _ in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=steps + 12,
                                         ignore_eos=True))
    return torch.cat(seen)


def time_sampler(logits, batch: int, params: dict, repeats: int) -> list[float]:
    from duplex.engine.request import Request
    from duplex.engine.sampler import Sampler
    from duplex.engine.sampling_params import SamplingParams

    sampler = Sampler(0)
    times = []
    for i in range(repeats):
        rows = logits[[(i * batch + j) % logits.shape[0] for j in range(batch)]].contiguous()
        reqs = [Request(f"r{j}", [1, 2, 3], SamplingParams(max_tokens=8, **params), (0,))
                for j in range(batch)]
        start = time.perf_counter()
        sampler(rows, reqs)
        times.append(time.perf_counter() - start)
    return times


def time_reference(logits, batch: int, params: dict, repeats: int) -> list[float]:
    import torch

    from duplex.kernels import cpu_sampler

    n = batch
    args = (torch.full((n,), params.get("temperature", 1.0)),
            torch.full((n,), params.get("top_k", 0)),
            torch.full((n,), params.get("top_p", 1.0), dtype=torch.float64),
            torch.full((n,), params.get("min_p", 0.0), dtype=torch.float64),
            torch.rand(n, dtype=torch.float64))
    times = []
    for i in range(repeats):
        rows = logits[[(i * batch + j) % logits.shape[0] for j in range(batch)]].contiguous()
        start = time.perf_counter()
        cpu_sampler.sample_ref(rows, *args)
        times.append(time.perf_counter() - start)
    return times


def run(args: argparse.Namespace) -> int:
    import torch

    logits = torch.load(args.logits) if args.logits else capture_logits(args.model, args.batch)
    if args.logits_out:
        torch.save(logits, args.logits_out)
    result = {"command": "duplex bench sampler", "args": vars(args),
              "torch_threads": torch.get_num_threads(), "rows": logits.shape[0],
              "vocab": logits.shape[1], "cases": []}
    for name, params in CASES.items():
        case = {"case": name, "sampler_ms": [t * 1e3 for t in
                                             time_sampler(logits, args.batch, params, args.repeats)]}
        if not args.skip_ref and params["temperature"] > 0 and "seed" not in params:
            case["reference_ms"] = [t * 1e3 for t in
                                    time_reference(logits, args.batch, params, 3)]
        result["cases"].append(case)
    print(markdown(result))
    if args.out:
        write_json(Path(args.out), result)
    return 0


def markdown(r: dict) -> str:
    lines = [f"batch {r['args']['batch']}, vocab {r['vocab']}, {r['torch_threads']} threads, "
             f"real logits ({r['rows']} rows)", "",
             "| sampling | Sampler median ms | best ms | torch reference median ms |",
             "|---|---|---|---|"]
    for c in r["cases"]:
        ref = statistics.median(c["reference_ms"]) if "reference_ms" in c else None
        lines.append(f"| {c['case']} | {statistics.median(c['sampler_ms']):.2f} | "
                     f"{min(c['sampler_ms']):.2f} | "
                     + (f"{ref:.1f} |" if ref is not None else "– |"))
    return "\n".join(lines)
