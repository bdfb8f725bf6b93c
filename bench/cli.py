"""`duplex bench <sub>`: one dispatcher for the benchmarks, each defined in its own module.

Each entry names a module exposing ``add_arguments(parser)`` and ``run(args) -> int``. A
module is imported only when its subcommand is parsed, so `duplex bench compare` never loads
aiohttp or torch; a module missing from this build answers "not available" with exit code 2.

The package (`duplex.bench`), the project's measuring instrument:

cli        the `duplex bench` dispatcher (lazy: each subcommand imports only its module)
serve      `bench serve`: drive an OpenAI-compatible server; `run_workload` for other code
runner     the load generator: closed loop, open loop (Poisson / gamma), trace replay
client     one streamed chat completion → a RequestRecord (every fault becomes a status)
record     RequestRecord: one request's timeline
metrics    TTFT, TPOT, ITL, e2e, throughput, goodput, cache hit rate, speculative acceptance
workloads  random, shared-prefix, multi-turn, agent, mooncake
text       exact-length text from the built-in corpus (corpus)
report     JSON result files, Markdown summaries, CDF and sweep plots
compare    `bench compare`: summaries side by side with ratios
machine    measured GEMM GFLOP/s and memory bandwidth; decode utilization
hf         tokenizer / plain transformers model loading from GGUF or HF directories
baseline_server  `bench baseline-server`: transformers `generate` behind the OpenAI API
"""
from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("duplex.bench.serve", "drive an OpenAI-compatible server with a workload"),
    "compare": ("duplex.bench.compare", "compare result files side by side"),
    "baseline-server": ("duplex.bench.baseline_server",
                        "plain transformers OpenAI-compatible server to compare against"),
    "offline": ("duplex.bench.offline", "offline engine throughput, no server"),
    "sampler": ("duplex.bench.sampler", "the batched sampler alone on a real model's logits"),
    "attention": ("duplex.bench.attention", "CPU decode attention alone, from cache and from DRAM, "
                  "beside the box's streaming read rate"),
    "gguf-linears": ("duplex.bench.gguf_linears", "one layer's linears of a GGUF file through "
                     "the decode and prompt kernels, at given row counts, in turns"),
    "eplb": ("duplex.bench.eplb", "expert-parallel load balancing benchmark"),
    "frontend-overhead": ("duplex.bench.overhead", "CPU time the API frontend adds per token"),
    "spec": ("duplex.bench.spec", "speculative decoding: drafters, confidence head"),
    "disagg": ("duplex.bench.disagg", "unified vs prefill/decode workers on mixed traffic"),
    "kv": ("duplex.bench.kv", "KV cache tiers: hit rates, cached TTFT, disk read rate"),
    "swa": ("duplex.bench.swa", "sliding-window models: bonded window replay vs full KV caching"),
    "quality": ("duplex.bench.quality", "model quality of each weight precision: perplexity and "
                "top-1 agreement with float32"),
    "invariance": ("duplex.bench.invariance", "batch dependence of outputs, with and without "
                   "--batch-invariant"),
    "structured": ("duplex.bench.structured", "grammar-constrained decoding: compile time, mask "
                   "time per step, tokens/s with and without constraints"),
    "anchor": ("duplex.bench.anchor", "Duplex beside llama.cpp's llama-server and llama-bench "
               "on the same GGUF"),
    "fuzz": ("duplex.bench.fuzz", "hypothesis bodies on every JSON endpoint of a real server: no 5xx"),
    "kernels": ("duplex.bench.kernels", "each triton kernel against torch eager (CUDA only)"),
    "gpu": ("duplex.bench.gpu_check", "the GPU check of issue 17 in one command inside a time "
            "budget: probes, pytest -m gpu, greedy equality, invariance, syncs, decode "
            "ms/step beside its floor, attention kernels against SDPA"),
}


class _LazyParser(argparse.ArgumentParser):
    """A subcommand parser that imports its module's arguments only when it is used."""

    def __init__(self, *args, module: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.module, self.is_loaded = module, False

    def parse_known_args(self, args=None, namespace=None):
        if not self.is_loaded:
            self.is_loaded = True
            try:
                importlib.import_module(self.module).add_arguments(self)
            except ModuleNotFoundError as e:
                if e.name != self.module:
                    raise
                namespace = namespace or argparse.Namespace()
                namespace._bench_missing = self.module
                return namespace, []
        return super().parse_known_args(args, namespace)


class _Formatter(argparse.HelpFormatter):
    """Wraps the description between benchmark names, never inside one (`frontend-overhead`)."""

    def _fill_text(self, text, width, indent):
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "benchmarks: " + ", ".join(SUBCOMMANDS)
    parser.formatter_class = _Formatter
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK",
                                parser_class=_LazyParser)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, module=module,
                           prog=f"duplex bench {name}")
        p.set_defaults(_bench_module=module)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_bench_missing", None):
        print(f"duplex bench {args.bench_command}: not available in this build "
              f"({args._bench_missing})", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._bench_module).run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    """`python -m duplex.bench.cli ...`, the same as `duplex bench ...`."""
    parser = argparse.ArgumentParser(prog="duplex bench")
    add_arguments(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
