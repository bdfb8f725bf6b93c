"""`duplex bench structured`: what grammar-constrained decoding costs, offline, no server.

Three figures on one EngineCore (the default model unless --model):

* grammar compile time, p50 / p99, over --num-schemas distinct JSON schemas (each a new
  cache key, compiled in the grammar thread against the model's vocabulary);
* output tokens/s of the same --num-requests prompts decoded together, plain and with every
  other request constrained to a JSON schema (STRUCTURED_SCHEMA of bench/workloads.py),
  alternated --repeats times, medians;
* mask time per step: time filling and unpacking masks, per engine step and per
  constrained row (engine/grammar.py counts it).

For served traffic use `duplex bench serve --workload structured` against `--workload
random` with the same seed and lengths.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from duplex.bench.workloads import STRUCTURED_SCHEMA


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--num-schemas", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    from duplex.engine.config import EngineConfig
    from duplex.engine.core import EngineCore

    core = EngineCore(EngineConfig(model=args.model), progress=False)
    compile_s = _compile_times(core, args.num_schemas)
    plain, constrained, mask_ms, row_ms = [], [], [], []
    for _ in range(args.repeats):
        plain.append(_decode(core, args, constrained=False)[0])
        rate, per_step, per_row = _decode(core, args, constrained=True)
        constrained.append(rate)
        mask_ms.append(per_step)
        row_ms.append(per_row)
    result = {
        "compile_ms": {"p50": _pct(compile_s, 0.5) * 1e3, "p99": _pct(compile_s, 0.99) * 1e3},
        "out_tok_s_plain": statistics.median(plain),
        "out_tok_s_half_constrained": statistics.median(constrained),
        "ratio": statistics.median(constrained) / statistics.median(plain),
        "mask_ms_per_step": statistics.median(mask_ms),
        "mask_ms_per_constrained_row": statistics.median(row_ms),
        "runs": {"plain": plain, "half_constrained": constrained},
    }
    print(json.dumps(result, indent=2))
    core.close()
    return 0


def _compile_times(core, num: int) -> list[float]:
    from duplex.engine.request import Request
    from duplex.engine.sampling_params import Constraint, SamplingParams

    times = []
    for i in range(num):
        schema = dict(STRUCTURED_SCHEMA, properties={
            **STRUCTURED_SCHEMA["properties"], f"field_{i}": {"type": "integer"}})
        params = SamplingParams(max_tokens=1, constraint=Constraint("json_schema",
                                                                   json.dumps(schema)))
        req = Request(f"compile-{i}", [1], params)
        start = time.perf_counter()
        core.grammar.submit(req)
        while not core.grammar.take_ready()[0]:
            time.sleep(0.0005)
        times.append(time.perf_counter() - start)
        core.grammar.free(req.req_id)
    return times[1:] if len(times) > 1 else times  # the first also loads the tokenizer


def _decode(core, args, constrained: bool) -> tuple[float, float, float]:
    """(output tokens/s, mask ms per step, mask ms per constrained row) of one batch."""
    from duplex.engine.messages import AddRequest
    from duplex.engine.sampling_params import Constraint, SamplingParams

    constraint = Constraint("json_schema", json.dumps(STRUCTURED_SCHEMA))
    for i in range(args.num_requests):
        prompt = [1, 198] + [(37 * i + 11 * j) % 20000 + 100 for j in range(32)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                constraint=constraint if constrained and i % 2 == 0 else None)
        core.add_request(AddRequest(f"{'c' if constrained else 'p'}{time.monotonic_ns()}-{i}",
                                    prompt, params))
    while core.grammar.num_waiting:  # compile outside the timed part (cached after once)
        core.step()
    mask_s0, rows0 = core.grammar.mask_seconds, core.grammar.num_masked_rows
    num_tokens, num_steps, start = 0, 0, time.perf_counter()
    while core.has_unfinished_requests():
        num_tokens += sum(len(d.new_token_ids) for d in core.step())
        num_steps += 1
    elapsed = time.perf_counter() - start
    mask_s, rows = core.grammar.mask_seconds - mask_s0, core.grammar.num_masked_rows - rows0
    return (num_tokens / elapsed, mask_s * 1e3 / max(1, num_steps),
            mask_s * 1e3 / max(1, rows))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
