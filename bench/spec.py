"""`duplex bench spec`: speculative decoding, offline through `engine.llm.LLM`.

For each configuration (speculation off, fixed-length n-gram, n-gram with the confidence
head, self-draft) and each workload, single stream (requests one after another) and at
concurrency 8 (all at once):

  * copy-heavy: edit, copy or summarise a document given in the prompt;
  * open chat: open-ended questions and creative requests.

All configurations stay loaded and their passes are interleaved, so load drifts on a
shared machine hit them alike; tokens per CPU-second (process time; run with one torch
thread) is reported next to wall-clock tokens/s as the load-robust figure.

Reported: output tokens/s, the speedup over speculation off, draft acceptance rate
(accepted / proposed) and mean acceptance length (tokens a verification round appends:
accepted drafts + 1). Greedy decoding throughout, so every configuration must produce
the very same tokens as speculation off (checked and reported). Also reported: the
measured verify cost of one token relative to a step's fixed cost (the stopping rule's
`spec_token_cost`) and the confidence head's calibration.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from duplex.bench.report import write_json

CONFIGS = {
    "off": dict(speculation="off"),
    "ngram-fixed": dict(speculation="ngram", spec_confidence=False),
    "ngram-confidence": dict(speculation="ngram", spec_confidence=True),
    "self-fixed": dict(speculation="self", spec_confidence=False),
    "self-confidence": dict(speculation="self", spec_confidence=True),
}

COPY_TASKS = (
    "Fix the spelling mistakes in the following text. Reply with the corrected text only.",
    "Copy the following text exactly, word for word.",
    "Rewrite the following text, keeping every sentence but making it more formal.",
    "Summarise the following document, quoting its key sentences.",
)
CHAT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for staying healthy? Explain each one.",
    "Describe your ideal weekend in a city you have never visited.",
    "Explain how a rainbow forms, for a ten-year-old.",
    "Give me five ideas for a birthday party for a friend who loves science.",
    "Why do cats purr? Answer in a friendly tone.",
    "Write a poem about autumn leaves and the first frost.",
    "What should I pack for a three-day hiking trip in the mountains?",
)
_TYPOS = (("the ", "teh "), ("and ", "adn "), ("which", "wich"), ("their", "thier"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2 GGUF)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {', '.join(CONFIGS)}")
    parser.add_argument("--num-single", type=int, default=4,
                        help="requests per workload in the single-stream run")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="passes per measurement, configurations interleaved")
    parser.add_argument("--kv-cache-bytes", type=int, default=128 * 1024 * 1024,
                        help="KV pool of each engine (all configurations stay loaded)")
    parser.add_argument("--out", default=None, help="write the JSON result here")


def workloads(concurrency: int) -> dict[str, list[list[dict]]]:
    """Chat conversations per workload; enough for the concurrent run."""
    from duplex.bench.corpus import PARAGRAPHS

    copy = []
    for i in range(max(concurrency, len(COPY_TASKS))):
        doc = PARAGRAPHS[i % len(PARAGRAPHS)] + "\n\n" + PARAGRAPHS[(i + 7) % len(PARAGRAPHS)]
        task = COPY_TASKS[i % len(COPY_TASKS)]
        if i % len(COPY_TASKS) == 0:
            for right, wrong in _TYPOS:
                doc = doc.replace(right, wrong, 2)
        copy.append([{"role": "user", "content": f"{task}\n\n{doc}"}])
    chat = [[{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}]
            for i in range(max(concurrency, len(CHAT_PROMPTS)))]
    return {"copy-heavy": copy, "open-chat": chat}


def _spec_counters(llm) -> dict[str, float]:
    spec = llm.engine.stats().spec
    if spec is None:
        return dict(proposed=0.0, accepted=0.0, rounds=0.0, emitted=0.0)
    return dict(proposed=spec.num_draft_proposed, accepted=spec.num_draft_accepted,
                rounds=spec.num_rounds, emitted=spec.num_emitted)


def measure(llm, conversations: list[list[dict]], params, concurrent: bool) -> dict:
    """One pass over conversations: wall and CPU seconds, tokens, speculation counters."""
    before = _spec_counters(llm)
    wall, cpu = time.perf_counter(), time.process_time()
    if concurrent:
        outputs = llm.chat(conversations, params)
    else:
        outputs = [out for c in conversations for out in llm.chat([c], params)]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = _spec_counters(llm)
    return dict(wall_s=wall, cpu_s=cpu, output_tokens=sum(len(o.token_ids) for o in outputs),
                token_ids=[o.token_ids for o in outputs],
                **{k: after[k] - before[k] for k in after})


def summarise(passes: list[dict]) -> dict:
    """Totals over the repeated passes of one (config, workload, mode)."""
    total = {k: sum(p[k] for p in passes) for k in ("wall_s", "cpu_s", "output_tokens",
                                                    "proposed", "accepted", "rounds", "emitted")}
    return dict(tok_s=total["output_tokens"] / total["wall_s"],
                cpu_tok_s=total["output_tokens"] / total["cpu_s"],
                output_tokens=total["output_tokens"], num_draft_proposed=total["proposed"],
                acceptance_rate=total["accepted"] / total["proposed"] if total["proposed"] else 0.0,
                mean_acceptance_length=total["emitted"] / total["rounds"] if total["rounds"]
                else 0.0)


def token_cost(llm, num_tokens: int = 32, repeats: int = 7) -> float:
    """Verify cost of one token relative to a step's fixed cost: forward time of one token
    vs num_tokens tokens of one sequence (median of repeats), t(n) = F (1 + c n)."""
    from duplex.engine.request import Request
    from duplex.engine.sampling_params import SamplingParams
    from duplex.engine.scheduler import ScheduledRequest

    core = llm.engine
    times = {}
    for n in (1, num_tokens):
        req = Request("cost", list(range(1, 129 + num_tokens)), SamplingParams())
        assert core.kv.allocate_slots(req, req.num_tokens), "token_cost needs free KV blocks"
        req.advance(req.num_tokens - n)
        inputs = core.runner.prepare([ScheduledRequest(req, n)], core.kv.tables)
        runs = []
        for _ in range(repeats):
            start = time.process_time()
            core.runner.execute(inputs, list(range(n)))
            runs.append(time.process_time() - start)
        core.kv.free(req)
        times[n] = statistics.median(runs)
    per_token = (times[num_tokens] - times[1]) / (num_tokens - 1)
    return per_token / max(times[1] - per_token, 1e-9)


def run(args: argparse.Namespace) -> int:
    import torch

    from duplex.engine.llm import LLM
    from duplex.engine.sampling_params import SamplingParams

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    loads = workloads(args.concurrency)
    engines = {name: LLM(args.model, progress=False, num_draft_tokens=args.num_draft_tokens,
                         num_threads=args.num_threads, kv_cache_bytes=args.kv_cache_bytes,
                         **CONFIGS[name]) for name in names}
    for llm in engines.values():
        llm.chat(loads["open-chat"][:1], SamplingParams(temperature=0.0, max_tokens=8))
    result = dict(command="duplex bench spec", args=vars(args), rows=[],
                  torch_threads=torch.get_num_threads(),
                  token_cost=token_cost(next(iter(engines.values()))))
    for workload, convs in loads.items():
        for mode, batch in (("single", convs[:args.num_single]),
                            (f"concurrency {args.concurrency}", convs[:args.concurrency])):
            passes = {name: [] for name in names}
            for _ in range(args.repeats):  # configurations interleaved: load drifts hit all
                for name, llm in engines.items():
                    passes[name].append(measure(llm, batch, params, mode != "single"))
            reference = passes[names[0]][0]["token_ids"]
            for name in names:
                row = summarise(passes[name])
                row.update(config=name, workload=workload, mode=mode,
                           identical=all(p["token_ids"] == reference for p in passes[name]))
                result["rows"].append(row)
                print(f"{name:17s} {workload:10s} {mode:14s} {row['tok_s']:7.2f} tok/s "
                      f"{row['cpu_tok_s']:7.2f} tok/cpu-s", flush=True)
    result["calibration"] = {name: llm.engine.spec.head.calibration.report()
                             for name, llm in engines.items() if llm.engine.spec is not None}
    print(markdown(result))
    if args.out:
        write_json(Path(args.out), result)
    return 0


def markdown(result: dict) -> str:
    base = {(r["workload"], r["mode"]): r for r in result["rows"] if r["config"] == "off"}
    lines = ["| workload | mode | config | tokens/s (wall) | vs off | tokens/CPU-s | vs off "
             "| acceptance | mean acc. length | same tokens |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in result["rows"]:
        off = base.get((r["workload"], r["mode"]))
        wall = f"{r['tok_s'] / off['tok_s']:.2f}x" if off else "-"
        cpu = f"{r['cpu_tok_s'] / off['cpu_tok_s']:.2f}x" if off else "-"
        lines.append(f"| {r['workload']} | {r['mode']} | {r['config']} | {r['tok_s']:.1f} | "
                     f"{wall} | {r['cpu_tok_s']:.1f} | {cpu} | {r['acceptance_rate']:.2f} | "
                     f"{r['mean_acceptance_length']:.2f} | {'yes' if r['identical'] else 'NO'} |")
    lines.append(f"\nmeasured verify cost per token / fixed step cost: {result['token_cost']:.3f} "
                 f"({result['torch_threads']} torch threads)")
    for name, report in result.get("calibration", {}).items():
        lines.append(f"confidence head ({name}): log-loss {report['log_loss']:.3f}, "
                     f"Brier {report['brier']:.3f}, ECE {report['ece']:.3f} "
                     f"over {report['num']} drafts")
    return "\n".join(lines)
