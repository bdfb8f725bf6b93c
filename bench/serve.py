"""`duplex bench serve`: drive an OpenAI-compatible server with a workload and report on it.

Reusable from other code without the CLI:

    from duplex.bench.serve import run_workload
    result = run_workload("http://127.0.0.1:8000", "multi-turn", num_conversations=4,
                          concurrency=2, max_duration_s=60)
    result["summary"]["ttft_ms"]["p50"]

`bench` / `bench_async` take a built `Workload` and a `LoadConfig` instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

from duplex.bench import metrics, report
from duplex.bench.metrics import Slo
from duplex.bench.record import RequestRecord
from duplex.bench.runner import LoadConfig, LoadResult, run_load, run_load_sync
from duplex.bench.workloads import WORKLOADS, AGENT_MARKS, Workload, WorkloadOptions, build_workload

DEFAULT_OUT = "out/bench"
DEFAULT_RANDOM_REQUESTS = 100


# ----- API -----------------------------------------------------------------------------------

def make_workload(name: str, tokenizer: str | None = None, **options) -> Workload:
    """Build workload `name` with the model's tokenizer (default: the default model's)."""
    from duplex.bench.hf import load_tokenizer
    from duplex.bench.text import TextSource
    workload_options = WorkloadOptions(**options)
    text = TextSource(load_tokenizer(tokenizer), seed=workload_options.seed)
    return build_workload(name, text, workload_options)


def run_workload(url: str, workload: str | Workload = "random", *, tokenizer: str | None = None,
                 slo: Slo = Slo(), label: str | None = None, **options) -> dict:
    """Run a workload (a name plus `WorkloadOptions` fields, or a built one) against `url`.

    Other keyword options are `LoadConfig` fields (concurrency, request_rate, num_requests,
    max_duration_s, ...). Returns the result dict; its "summary" holds the metrics.
    """
    load_names = {f.name for f in dataclasses.fields(LoadConfig)}
    load = LoadConfig(url=url, **{k: v for k, v in options.items() if k in load_names})
    if isinstance(workload, str):
        workload_options = {k: v for k, v in options.items() if k not in load_names}
        workload_options.setdefault("seed", load.seed)
        if load.num_requests:          # build no more than will be sent
            workload_options.setdefault("num_requests", load.num_requests)
            workload_options.setdefault("max_requests", load.num_requests)
        workload = make_workload(workload, tokenizer, **workload_options)
    return bench(workload, load, slo, label)


def bench(workload: Workload, load: LoadConfig, slo: Slo = Slo(), label: str | None = None) -> dict:
    return result_dict(workload, load, run_load_sync(workload.conversations, load), slo, label)


async def bench_async(workload: Workload, load: LoadConfig, slo: Slo = Slo(),
                      label: str | None = None) -> dict:
    return result_dict(workload, load, await run_load(workload.conversations, load), slo, label)


def result_dict(workload: Workload, load: LoadConfig, outcome: LoadResult, slo: Slo,
                label: str | None) -> dict:
    summary = metrics.summarize(outcome.records, outcome.duration_s, outcome.num_planned, slo)
    return {
        "label": label or default_label(workload.name, load, outcome.mode),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "url": load.url,
        "mode": outcome.mode,
        "timed_out": outcome.timed_out,
        "workload": {"name": workload.name, "params": workload.params,
                     "num_requests": workload.num_requests},
        "load": load.public(),
        "summary": summary,
        "records": [r.to_json() for r in outcome.records],
    }


def default_label(workload: str, load: LoadConfig, mode: str) -> str:
    if mode == "rate":
        return f"{workload}-r{load.request_rate:g}"
    return f"{workload}-trace" if mode == "trace" else f"{workload}-c{load.concurrency or 1}"


# ----- CLI -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_server_arguments(parser.add_argument_group("server"))
    _add_workload_arguments(parser.add_argument_group("workload"))
    _add_load_arguments(parser.add_argument_group("load"))
    _add_report_arguments(parser.add_argument_group("report"))


def _add_server_arguments(target) -> None:
    target.add_argument("--url", default="http://127.0.0.1:8000")
    target.add_argument("--endpoint", default="/v1/chat/completions")
    target.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="model name sent in requests")
    target.add_argument("--api-key", default=None)
    target.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                        help="extra request header (repeatable)")
    target.add_argument("--tokenizer", default=None,
                        help="GGUF file or HF directory whose tokenizer sizes prompts "
                             "(default: the default model)")


def _add_workload_arguments(work) -> None:
    work.add_argument("--workload", choices=WORKLOADS, default="random")
    defaults = WorkloadOptions()
    for name, help_text in (
            ("input_len", "tokens of each user message (prompt, question, turn, agent task)"),
            ("output_len", "max output tokens per request"),
            ("system_len", "tokens of the shared system prompt"),
            ("num_groups", "shared-prefix: groups"),
            ("prompts_per_group", "shared-prefix: prompts per group"),
            ("num_conversations", "multi-turn / agent: conversations"),
            ("num_turns", "multi-turn / agent: turns (steps) per conversation"),
            ("tool_output_len", "agent: tokens of each tool result"),
            ("tokens_per_block", "mooncake: text tokens per trace hash id"),
            ("max_model_len", "mooncake: context length prompts and outputs must fit")):
        work.add_argument("--" + name.replace("_", "-"), type=int,
                          default=getattr(defaults, name), help=help_text)
    work.add_argument("--agent-mark", choices=AGENT_MARKS, default=defaults.agent_mark,
                      help="agent: mark traffic with the x-duplex-retention header, tools, both")
    work.add_argument("--trace", default=None, help="mooncake: trace file (default "
                      "../shared/traces/mooncake_conversation_trace.jsonl from the repo)")
    work.add_argument("--time-scale", type=float, default=1.0,
                      help="mooncake: divide trace arrival times by this")
    work.add_argument("--max-requests", type=int, default=None,
                      help="mooncake: trace lines to read (default: --num-requests, else all)")
    work.add_argument("--sessions", type=int, default=0,
                      help="mooncake: replay the first N multi-request sessions of the trace "
                           "(0: trace lines in order)")
    work.add_argument("--output-scale", type=float, default=1.0,
                      help="mooncake: multiply trace output lengths by this")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="ask the server to generate exactly max_tokens (ignore_eos)")


def _add_load_arguments(load) -> None:
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed loop with N clients (default 1); with --request-rate, a "
                           "cap on requests in flight")
    load.add_argument("--request-rate", type=float, default=None,
                      help="open loop: conversation starts per second (inf = all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival gaps (1 = Poisson)")
    load.add_argument("--sweep-rates", default=None, metavar="R1,R2,...",
                      help="run once per request rate and plot throughput and TTFT vs rate")
    load.add_argument("--num-requests", type=int, default=None,
                      help=f"requests to send (random: default {DEFAULT_RANDOM_REQUESTS}; "
                           "others: the whole workload)")
    load.add_argument("--max-duration", type=float, default=600.0,
                      help="seconds; requests still running then are cancelled and counted")
    load.add_argument("--request-timeout", type=float, default=300.0,
                      help="seconds one request may take")
    load.add_argument("--seed", type=int, default=0)


def _add_report_arguments(out) -> None:
    out.add_argument("--out", default=DEFAULT_OUT, help="directory for JSON, Markdown, PNG")
    out.add_argument("--label", default=None, help="file name stem (default from the run)")
    out.add_argument("--ttft-slo-ms", type=float, default=None)
    out.add_argument("--tpot-slo-ms", type=float, default=None)
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    out.add_argument("--skip-machine", action="store_true",
                     help="do not measure GEMM GFLOP/s and memory bandwidth")
    out.add_argument("--gemm-shapes", default=None, metavar="MxNxK,...")
    out.add_argument("--machine-device", default="cpu",
                     help="torch device the machine figures are measured on (cpu, cuda)")
    out.add_argument("--model-gflop-per-token", type=float, default=None,
                     help="report decode compute as a fraction of peak (SmolLM2-135M: 0.27)")
    out.add_argument("--model-bytes-per-step", type=float, default=None,
                     help="weight bytes read per decode step (SmolLM2-135M fp32: 5.4e8)")


def run(args: argparse.Namespace) -> int:
    try:
        load, rates = _load_config(args), _rates(args.sweep_rates)
        workload_options = dataclasses.asdict(_workload_options(args))
    except ValueError as e:
        return _usage_error(e)
    machine = _machine(args)
    print(report.machine_markdown(machine), flush=True)
    try:
        workload = make_workload(args.workload, args.tokenizer, **workload_options)
    except (OSError, ValueError) as e:
        return _usage_error(e)
    slo = Slo(args.ttft_slo_ms, args.tpot_slo_ms)
    summaries = [_run_once(args, workload, load, slo, machine)] if not rates else \
        _run_sweep(args, workload, load, slo, machine, rates)
    return 0 if any(s["completed"] for s in summaries) else 1


def _run_once(args, workload: Workload, load: LoadConfig, slo: Slo, machine) -> dict:
    return _finish(bench(workload, load, slo, args.label), args, machine)["summary"]


def _run_sweep(args, workload: Workload, load: LoadConfig, slo: Slo, machine,
               rates: list[float]) -> list[dict]:
    points = []
    for rate in rates:
        label = f"{args.label or workload.name}-r{rate:g}"
        result = bench(workload, dataclasses.replace(load, request_rate=rate), slo, label)
        _finish(result, args, machine)
        points.append({"request_rate": rate, "label": label, "summary": result["summary"]})
    _finish_sweep(args, workload, machine, points)
    return [p["summary"] for p in points]


def _usage_error(error: Exception) -> int:
    print(f"duplex bench serve: {error}", file=sys.stderr)
    return 2


def _load_config(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(
        url=args.url, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
        concurrency=args.concurrency, request_rate=args.request_rate,
        burstiness=args.burstiness, num_requests=args.num_requests,
        max_duration_s=args.max_duration, request_timeout_s=args.request_timeout,
        seed=args.seed, temperature=args.temperature, ignore_eos=args.ignore_eos,
        headers=tuple(_header(h) for h in args.header), progress=not args.no_progress)


def _workload_options(args: argparse.Namespace) -> WorkloadOptions:
    names = {f.name for f in dataclasses.fields(WorkloadOptions)} - {"num_requests", "seed"}
    max_requests = args.max_requests if args.max_requests is not None else args.num_requests
    return WorkloadOptions(
        num_requests=args.num_requests or DEFAULT_RANDOM_REQUESTS, seed=args.seed,
        **{n: getattr(args, n) for n in names if n != "max_requests"}, max_requests=max_requests)


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--header wants NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def _rates(text: str | None) -> list[float]:
    if not text:
        return []
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--sweep-rates wants positive rates, got {text!r}")
    return rates


def _machine(args: argparse.Namespace) -> dict | None:
    if args.skip_machine:
        return None
    from duplex.bench.machine import DEFAULT_GEMM_SHAPES, measure_machine, parse_shapes
    shapes = parse_shapes(args.gemm_shapes) if args.gemm_shapes else DEFAULT_GEMM_SHAPES
    return measure_machine(shapes, device=args.machine_device)


def _finish(result: dict, args: argparse.Namespace, machine: dict | None) -> dict:
    """Add machine figures, then write JSON, Markdown and CDF plot; print the Markdown."""
    from duplex.bench.machine import decode_utilization
    result["machine"] = machine
    result["utilization"] = decode_utilization(
        result["summary"], machine, args.model_gflop_per_token,
        args.model_bytes_per_step) if machine else {}
    out = Path(args.out)
    text = report.run_markdown(result)
    paths = [report.write_json(out / f"{result['label']}.json", result),
             report.write_text(out / f"{result['label']}.md", text)]
    if not args.no_plots:
        records = [RequestRecord.from_json(r) for r in result["records"]]
        paths.append(report.plot_cdfs(records, out / f"{result['label']}_cdf.png",
                                      result["label"]))
    print(text + "\n" + "\n".join(f"wrote {p}" for p in paths), flush=True)
    return result


def _finish_sweep(args: argparse.Namespace, workload: Workload, machine: dict | None,
                  points: list[dict]) -> None:
    label = f"{args.label or workload.name}-sweep"
    sweep = {"label": label, "command": sys.argv, "machine": machine,
             "workload": {"name": workload.name, "params": workload.params}, "points": points}
    out = Path(args.out)
    text = report.sweep_markdown(sweep)
    paths = [report.write_json(out / f"{label}.json", sweep),
             report.write_text(out / f"{label}.md", text)]
    if not args.no_plots:
        paths.append(report.plot_sweep(points, out / f"{label}.png", label))
    print(text + "\n" + "\n".join(f"wrote {p}" for p in paths), flush=True)

