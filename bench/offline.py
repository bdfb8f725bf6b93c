"""`duplex bench offline`: the engine against plain transformers, no server, one process.

Side by side on the same machine in one run:
  1. 32 requests (prompt 20–400 tokens, output 16–256 tokens, ignore_eos): Duplex's
     continuous batching vs transformers `generate` on padded static batches.
  2. batch-1 decode tokens/s for both.
  3. the machine's fp32 GEMM rate at the model's own GEMM shapes (M = 1, 32, 64), each
     layer with its own weights (so the weights stream from memory, as in the engine), and
     the engine's whole decode step at batch 1, 32, 64 as a fraction of it: the share of the
     step that is useful matmul, the rest being attention, sampling and overhead.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from duplex.bench.report import write_json
from duplex.engine.config import KV_CACHE_DTYPES, OVERLAP_MODES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2 GGUF)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=400)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--hf-batch-size", type=int, default=8,
                        help="static batch size for the transformers baseline")
    parser.add_argument("--batch1-tokens", type=int, default=128)
    parser.add_argument("--batch1-rounds", type=int, default=3,
                        help="batch-1 decode: alternate engine and transformers this many "
                             "times and take medians (side by side on a noisy box)")
    parser.add_argument("--step-batches", default="1,32,64")
    parser.add_argument("--step-context", type=int, default=128,
                        help="context length of each sequence in the decode-step measurement")
    parser.add_argument("--step-temperature", type=float, default=0.0,
                        help="sampling of the step profile's requests (0: greedy)")
    parser.add_argument("--step-top-p", type=float, default=1.0)
    parser.add_argument("--weights-dtype", "--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--overlap", default="auto", choices=OVERLAP_MODES,
                        help="overlapped scheduling (engine/core.py): auto (on a GPU), on, off")
    parser.add_argument("--skip-hf", action="store_true", help="engine figures only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the JSON result here")


def make_workload(tokenizer, n: int, prompt_range, output_range, seed: int):
    from duplex.bench.text import TextSource

    rng = random.Random(seed)
    source = TextSource(tokenizer, seed)
    prompts = [source.text(rng.randint(*prompt_range), rng).token_ids for _ in range(n)]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return prompts, outputs


def run_engine(llm, prompts, outputs) -> dict:
    from duplex.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.generate(prompts[:2], params[:2])  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(r.token_ids) for r in results)
    return {"seconds": elapsed, "output_tokens": num_out, "output_tok_s": num_out / elapsed}


def run_hf(model, prompts, outputs, batch_size: int) -> dict:
    import torch

    start = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i:i + batch_size], outputs[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                                 min_new_tokens=max(lens), do_sample=False, pad_token_id=0)
        assert out.shape[1] - width == max(lens)
        useful += sum(lens)  # a static batch runs to its longest request; count only asked-for tokens
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": useful, "output_tok_s": useful / elapsed}


def batch1_engine(llm, prompt, num_tokens: int) -> float:
    from duplex.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    llm.generate([prompt], params)
    return num_tokens / (time.perf_counter() - start)


def batch1_hf(model, prompt, num_tokens: int) -> float:
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                       do_sample=False, pad_token_id=0)
    return num_tokens / (time.perf_counter() - start)


def gemm_shapes(args) -> list[tuple[int, int]]:
    """(N, K) of every weight GEMM of one decoder layer (fused the way the engine runs them)."""
    q = args.num_heads * args.head_dim
    kv = args.num_kv_heads * args.head_dim
    return [(q + 2 * kv, args.hidden_size), (args.hidden_size, q),
            (2 * args.intermediate_size, args.hidden_size),
            (args.hidden_size, args.intermediate_size)]


def step_gemms(args) -> list[tuple[int, int]]:
    """(N, K) of every weight GEMM of one decode step, in order: each layer's, then the LM head."""
    return gemm_shapes(args) * args.num_layers + [(args.vocab_size, args.hidden_size)]


def step_weights(args) -> list:
    """One distinct random fp32 weight per GEMM of the step (`step_gemms` order), so that a
    timed step streams every layer's weights from memory as the engine's step does, instead
    of finding a few shared tensors in cache."""
    import torch

    return [torch.randn(n, k) for n, k in step_gemms(args)]


def model_step_weights(model) -> list | None:
    """The model's own weights in `step_gemms` order (quantized ones as they run), or None
    for a model without the dense Llama layout."""
    try:
        return [w for layer in model.layers for w in (
            layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight,
            layer.mlp.down_weight)] + [model.lm_head]
    except AttributeError:
        return None


def isolated_gemm_seconds(args, m: int, repeats: int = 20,
                          weights: list | None = None) -> tuple[float, float]:
    """Time of one decode step's weight GEMMs (all layers + LM head for m rows), run alone
    on the model's own shapes with distinct weights per layer — the engine's own weights in
    their own precision when given (`model_step_weights`), else random fp32 ones; returns
    (seconds, GFLOP)."""
    one_pass, gflop = gemm_pass(args, m, weights)
    return statistics.median(one_pass() for _ in range(repeats)), gflop


def gemm_pass(args, m: int, weights: list | None = None):
    """(a function timing one pass of the step's GEMMs alone, in seconds; their GFLOP),
    warmed up: see isolated_gemm_seconds."""
    import torch

    from duplex.kernels import ops

    weights = step_weights(args) if weights is None else weights
    # each GEMM in its own precision: bf16 rows into a weight whose bf16 dense copy takes m
    # rows (no conversion op around it, as in the engine's bf16 stream), fp32 otherwise
    inputs = [torch.randn(m, w.shape[1], dtype=_gemm_input_dtype(w, m)) for w in weights]
    flop = sum(2.0 * m * w.shape[0] * w.shape[1] for w in weights)

    def one_pass() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            for x, w in zip(inputs, weights):
                ops.linear(x, w)
            return time.perf_counter() - start

    one_pass()  # warm-up: first touch of every page
    return one_pass, flop / 1e9


def _gemm_input_dtype(w, m: int):
    import torch

    from duplex.kernels.quant import QuantWeight

    dense_from = w.dense_from_rows() if isinstance(w, QuantWeight) else None
    return torch.bfloat16 if dense_from is not None and m >= dense_from else torch.float32


class _TimedSampler:
    """The engine's sampler, timing each step's draws: the launch and, when its result is
    read, the read (one entry per step)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seconds: list[float] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, *args, **kwargs):
        start = time.perf_counter()
        draws = self.inner.launch(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        entry, result = len(self.seconds) - 1, draws.result

        def timed_result():
            start = time.perf_counter()
            out = result()
            self.seconds[entry] += time.perf_counter() - start
            return out
        draws.result = timed_result
        return draws


def decode_step_seconds(llm, batch: int, context: int, steps: int = 12,
                        temperature: float = 0.0, top_p: float = 1.0,
                        between=None) -> tuple[float, float, list[float], list[float]]:
    """Median wall time of one engine step with `batch` sequences all decoding, the median
    time of its sampler call, every step's time, and what `between()` (called after each
    step, when given) returned each time."""
    from duplex.engine.messages import AddRequest
    from duplex.engine.sampling_params import SamplingParams

    core = llm.engine
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=steps + 64,
                            ignore_eos=True)
    rng = random.Random(batch)
    ids = [f"step-{batch}-{i}" for i in range(batch)]
    for req_id in ids:
        prompt = [rng.randrange(100, min(20000, core.vocab_size)) for _ in range(context)]
        core.add_request(AddRequest(req_id, prompt, params))
    while any(r.num_output_tokens == 0 for r in core.requests.values()):
        core.step()  # prefill everything first
    times, paired = [], []
    sampler, core.sampler = core.sampler, _TimedSampler(core.sampler)
    try:
        for _ in range(steps):
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
            if between is not None:
                paired.append(between())
        sampled = core.sampler.seconds
    finally:
        core.sampler = sampler
    core.abort_requests(ids)
    core.step()
    return statistics.median(times), statistics.median(sampled), times, paired


def run(args: argparse.Namespace) -> int:
    import torch

    from duplex.bench.hf import load_model, load_tokenizer
    from duplex.bench.machine import measure_machine
    from duplex.engine.config import resolve_model_path
    from duplex.engine.llm import LLM

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    machine = measure_machine()
    llm = LLM(path, weights_dtype=args.weights_dtype, kv_cache_dtype=args.kv_cache_dtype,
              batch_invariant=args.batch_invariant, overlap=args.overlap,
              max_num_seqs=max(64, args.num_requests), progress=False, tokenizer=False)
    prompts, outputs = make_workload(tokenizer, args.num_requests,
                                     (args.min_prompt, args.max_prompt),
                                     (args.min_output, args.max_output), args.seed)
    result = {"command": "duplex bench offline", "args": vars(args), "machine": machine,
              "torch_threads": torch.get_num_threads()}
    result["engine"] = run_engine(llm, prompts, outputs)
    model = None if args.skip_hf else load_model(path)
    engine_b1, hf_b1 = [], []
    for _ in range(max(1, args.batch1_rounds)):  # interleaved: both see the same box
        engine_b1.append(batch1_engine(llm, prompts[0], args.batch1_tokens))
        if model is not None:
            hf_b1.append(batch1_hf(model, prompts[0], args.batch1_tokens))
    result["engine_batch1_tok_s"] = statistics.median(engine_b1)
    result["engine_batch1_rounds"] = engine_b1
    result["steps"] = []
    for b in [int(x) for x in args.step_batches.split(",")]:
        # each step is followed by one pass of its GEMMs alone, so the two see the same box
        # (this VM's speed drifts by tens of percent within a minute): the fraction is the
        # median of the 20 pairs' ratios
        one_pass, gflop = gemm_pass(llm.engine.args, b, model_step_weights(llm.engine.model))
        step_s, sampler_s, steps, gemms = decode_step_seconds(
            llm, b, args.step_context, steps=20, temperature=args.step_temperature,
            top_p=args.step_top_p, between=one_pass)
        gemm_s = statistics.median(gemms)
        result["steps"].append({"batch": b, "step_ms": step_s * 1e3, "gemm_ms": gemm_s * 1e3,
                                "sampler_ms": sampler_s * 1e3,
                                "gemm_gflops": gflop / gemm_s, "step_gflops": gflop / step_s,
                                "fraction_of_gemm_rate": statistics.median(
                                    g / s for g, s in zip(gemms, steps))})
    if model is not None:
        result["hf"] = run_hf(model, prompts, outputs, args.hf_batch_size)
        result["hf_batch1_tok_s"] = statistics.median(hf_b1)
        result["hf_batch1_rounds"] = hf_b1
        result["speedup"] = result["engine"]["output_tok_s"] / result["hf"]["output_tok_s"]
        result["batch1_speedup"] = result["engine_batch1_tok_s"] / result["hf_batch1_tok_s"]
    print(markdown(result))
    if args.out:
        write_json(Path(args.out), result)
    return 0


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [f"machine: {m['cpu']}, {r['torch_threads']} torch threads, peak fp32 GEMM "
             f"{m['peak_gflops']:.1f} GFLOP/s, copy bandwidth {m['bandwidth_gbs']:.1f} GB/s", "",
             "| workload | Duplex | transformers | ratio |", "|---|---|---|---|"]
    hf = r.get("hf")
    e = r["engine"]
    lines.append(f"| {r['args']['num_requests']} requests, output tok/s | {e['output_tok_s']:.1f} | "
                 + (f"{hf['output_tok_s']:.1f} | {r['speedup']:.2f}x |" if hf else "– | – |"))
    lines.append(f"| batch 1 decode tok/s | {r['engine_batch1_tok_s']:.1f} | "
                 + (f"{r['hf_batch1_tok_s']:.1f} | {r['batch1_speedup']:.2f}x |" if hf else "– | – |"))
    a = r["args"]
    lines += ["", f"step profile sampling: temperature {a['step_temperature']}, top_p "
              f"{a['step_top_p']}", "",
              "| decode batch | step ms | GEMMs alone ms | GEMM GFLOP/s alone | step GFLOP/s "
              "| step at % of GEMM rate | sampler ms | sampler % of step |",
              "|---|---|---|---|---|---|---|---|"]
    for s in r["steps"]:
        lines.append(f"| {s['batch']} | {s['step_ms']:.1f} | {s['gemm_ms']:.1f} | "
                     f"{s['gemm_gflops']:.1f} | {s['step_gflops']:.1f} | "
                     f"{100 * s['fraction_of_gemm_rate']:.0f} % | {s['sampler_ms']:.2f} | "
                     f"{100 * s['sampler_ms'] / s['step_ms']:.1f} % |")
    return "\n".join(lines)
