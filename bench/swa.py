"""`duplex bench swa`: prefix caching for a sliding-window model, offline, three ways.

A multi-turn chat workload (a shared system prompt, several conversations, each turn the
whole history plus a new user message) runs one request at a time on a tiny random hybrid
model (Gemma 3 layout: most layers slide over a window, a few attend to everything) under

    (a) no prefix caching           every prompt computed in full
    (b) all-layer KV caching         hybrid_kv off: every layer keeps every block
    (c) bonded window replay         engine/hybrid_kv.py: full layers keep every block,
                                     SWA layers only bonded windows; misses replay

and reports prefill FLOPs (each computed prompt token x each layer's cost: its matmuls plus
attention over the keys it sees), the median TTFT, and KV bytes stored per cached token.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from duplex.engine.config import EngineConfig
from duplex.engine.core import EngineCore
from duplex.engine.messages import AddRequest
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.stats import HybridKVStats

MODES = {"a_no_cache": dict(enable_prefix_caching=False),
         "b_all_layer_kv": dict(hybrid_kv=False),
         "c_bonded_replay": dict(hybrid_kv=True)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model (random init)")
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--full-layers", type=int, default=2, help="full-attention layers among them")
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--window", type=int, default=128)
    w = parser.add_argument_group("workload")
    w.add_argument("--system-tokens", type=int, default=512)
    w.add_argument("--conversations", type=int, default=4)
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--user-tokens", type=int, default=192)
    w.add_argument("--reply-tokens", type=int, default=32)
    w.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")


def build_model(root: str, args) -> str:
    import transformers as tf

    layer_types = ["sliding_attention"] * args.layers
    step = args.layers // max(1, args.full_layers)
    for i in range(args.full_layers):
        layer_types[(i + 1) * step - 1] = "full_attention"
    config = tf.Gemma3TextConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.hidden // 4, sliding_window=args.window, layer_types=layer_types,
        max_position_embeddings=4096, query_pre_attn_scalar=args.hidden // 4)
    torch.manual_seed(0)
    tf.Gemma3ForCausalLM(config).save_pretrained(root, safe_serialization=True)
    return root


def workload(args) -> list[list[int]]:
    """Prompts in arrival order: turn t of every conversation, then turn t + 1. Replies are
    filled in as they are generated, so each turn's prompt holds the real history."""
    gen = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(0, 1024, (n,), generator=gen).tolist()  # noqa: E731
    system = draw(args.system_tokens)
    return [[system] + [draw(args.user_tokens) for _ in range(args.turns)]
            for _ in range(args.conversations)]


def layer_flops(core: EngineCore, window: int | None, position: int) -> float:
    """FLOPs of one token at `position` in one layer: matmuls plus attention scores/values."""
    a = core.args
    params = a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim \
        + a.num_heads * a.head_dim * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
    keys = position + 1 if window is None else min(window, position + 1)
    return 2.0 * params + 4.0 * a.num_heads * a.head_dim * keys


def prefill_flops(core: EngineCore, start: int, end: int) -> float:
    return sum(layer_flops(core, w, p) for w in core.model.layer_windows for p in range(start, end))


def run_mode(path: str, args, fields: dict) -> dict:
    core = EngineCore(EngineConfig.of(model=path, block_size=args.block_size, num_kv_blocks=2048,
                                   max_num_batched_tokens=512, **fields), progress=False)
    params = SamplingParams(temperature=0, max_tokens=args.reply_tokens, ignore_eos=True)
    histories = [[] for _ in range(args.conversations)]
    convs = workload(args)
    flops, ttfts, outputs = 0.0, [], []
    for turn in range(args.turns):
        for c, parts in enumerate(convs):
            prompt = histories[c] + (parts[0] if turn == 0 else []) + parts[turn + 1]
            req_id = f"c{c}t{turn}"
            out, ttft, cached = _run(core, req_id, prompt, params)
            start = _first_computed(core, req_id, cached)
            flops += prefill_flops(core, start, len(prompt))
            ttfts.append(ttft)
            outputs.append(out)
            histories[c] = prompt + out
    kv = core.stats().kv
    hybrid = kv.hybrid or HybridKVStats()
    cached_tokens = kv.blocks_cached * args.block_size
    stored = hybrid.bytes_stored if kv.hybrid is not None else kv.device.bytes
    core.close()
    return dict(prefill_gflops=flops / 1e9, ttft_median_ms=1e3 * statistics.median(ttfts),
                ttft_mean_ms=1e3 * statistics.mean(ttfts),
                kv_bytes_per_cached_token=stored / cached_tokens if cached_tokens else 0.0,
                tokens_replayed=hybrid.tokens_replayed, tokens_restored=hybrid.tokens_restored,
                outputs=outputs)


def _first_computed(core: EngineCore, req_id: str, num_cached: int) -> int:
    accounting = getattr(core.kv, "accounting", None)
    if accounting is not None and req_id in accounting:
        return accounting[req_id].num_restored  # replayed tokens are computed too
    return num_cached


def _run(core: EngineCore, req_id: str, prompt: list[int], params) -> tuple[list[int], float, int]:
    start, ttft, out, cached = time.perf_counter(), None, [], 0
    core.add_request(AddRequest(req_id, prompt, params))
    while core.has_unfinished_requests():
        for delta in core.step():
            if delta.new_token_ids and ttft is None:
                ttft = time.perf_counter() - start
            out += delta.new_token_ids
            cached = delta.num_cached_tokens
    return out, ttft, cached


def to_markdown(results: dict) -> str:
    b, a = results["b_all_layer_kv"], results["a_no_cache"]
    lines = ["| mode | prefill GFLOP | vs (a) | vs (b) | TTFT median ms | KV B/cached token "
             "| vs (b) | replayed | restored |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        bytes_ratio = r["kv_bytes_per_cached_token"] / b["kv_bytes_per_cached_token"] \
            if r["kv_bytes_per_cached_token"] else float("nan")
        lines.append(f"| {name} | {r['prefill_gflops']:.2f} | "
                     f"{r['prefill_gflops'] / a['prefill_gflops']:.2f} | "
                     f"{r['prefill_gflops'] / b['prefill_gflops']:.2f} | "
                     f"{r['ttft_median_ms']:.1f} | {r['kv_bytes_per_cached_token']:.0f} | "
                     f"{bytes_ratio:.2f} | {r['tokens_replayed']:.0f} | "
                     f"{r['tokens_restored']:.0f} |")
    lines.append(f"\nsame greedy outputs in all modes: {results['same_outputs']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="duplex-swa-bench-") as root:
        path = build_model(root, args)
        results = {name: run_mode(path, args, fields) for name, fields in MODES.items()}
    outputs = [r.pop("outputs") for r in results.values()]
    results["same_outputs"] = all(o == outputs[0] for o in outputs)
    print(to_markdown(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
