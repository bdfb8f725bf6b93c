"""`duplex bench fuzz`: the long fuzz run — hypothesis bodies for every JSON endpoint against a
real `duplex serve` (the default model unless --model), checking that no body gives a 5xx,
every error is in its API's shape and every stream ends with its terminal event.

    duplex bench fuzz --examples 500          start a server, 500 bodies per endpoint family
    duplex bench fuzz --url http://HOST:PORT  fuzz a server that is already running

The bodies are `bench/fuzz_bodies.py`, the same the bounded run in `make test` uses (there
against fakes, 120 per family). Needs the test extra (hypothesis). Writes a JSON summary:
examples, statuses per endpoint, problems found, wall time.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import urllib.error
import urllib.request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", default=None, help="model of the server it starts")
    parser.add_argument("--examples", type=int, default=500, metavar="N",
                        help="bodies per endpoint family (chat, completions, messages, raw, "
                             "deep nesting)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, metavar="JSON", help="write the summary here")


def run(args: argparse.Namespace) -> int:
    try:
        import hypothesis  # noqa: F401 - the test extra
    except ModuleNotFoundError:
        print("duplex bench fuzz: needs hypothesis (pip install -e '.[test]')", file=sys.stderr)
        return 2
    if args.url:
        summary = fuzz(args.url.rstrip("/"), args.examples, args.seed)
    else:
        from duplex.bench.server_proc import free_port, running_server
        port = free_port()
        serve = ["serve", "--max-model-len", "256", *(["--model", args.model] if args.model
                                                      else [])]
        with running_server(serve, port):
            summary = fuzz(f"http://127.0.0.1:{port}", args.examples, args.seed)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if summary["problems"] else 0


def fuzz(url: str, num_examples: int, seed: int) -> dict:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from duplex.bench.fuzz_bodies import BODIES, RAW_PATHS, deep_body, problem, raw_body

    statuses: collections.Counter = collections.Counter()
    problems: list[str] = []

    def post(path: str, body) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, content_type, text = _post(url + path, data)
        statuses[f"{path} {status}"] += 1
        wrong = problem(path, status, content_type, text)
        if wrong is not None and len(problems) < 50:
            problems.append(f"{wrong} <- body {data[:500].decode(errors='replace')}")

    config = settings(max_examples=num_examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
    def to(path: str):
        return lambda body: post(path, _short(body))

    def anywhere(body, path) -> None:
        post(path, body)

    families = [given(body=strategy)(to(path)) for path, strategy in BODIES.items()]
    families += [given(body=bodies, path=st.sampled_from(RAW_PATHS))(anywhere)
                 for bodies in (raw_body, deep_body)]
    start = time.perf_counter()
    for name, family in zip([*BODIES, "raw", "deep"], families):
        settings(config)(_seeded(family, seed))()
        print(f"fuzzed {name}: {sum(statuses.values())} requests so far, "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    wall_s = time.perf_counter() - start
    total = sum(statuses.values())
    return {"url": url, "examples_per_family": num_examples, "requests": total,
            "wall_s": round(wall_s, 1), "requests_per_s": round(total / wall_s, 1),
            "num_5xx": sum(n for k, n in statuses.items() if k.rsplit(" ", 1)[1] >= "500"),
            "problems": problems, "statuses": dict(sorted(statuses.items()))}


def _short(body):
    """A real model generates what a body asks for: at most 4 tokens (none given: 4, not the
    rest of the context), so the run spends its time on many bodies, not on long answers.
    Other values, wrong types included, are left as fuzzed."""
    if not isinstance(body, dict):
        return body
    max_tokens = body.get("max_tokens", 4)
    if type(max_tokens) is int and max_tokens > 4:
        max_tokens = 4
    return {**body, "max_tokens": max_tokens}


def _seeded(test, seed: int):
    from hypothesis import seed as hypothesis_seed
    return hypothesis_seed(seed)(test)


def _post(url: str, data: bytes) -> tuple[int, str, str]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers.get("Content-Type", ""), \
                response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode(errors="replace")
