"""`duplex bench attention`: the CPU attention kernels alone, against the box's memory and torch.

A batch-64 decode step reads every sequence's keys and values once a layer. This times
kernels/cpu_attention.c at a decode step's own shapes (SmolLM2's heads by default, paged
blocks in a shuffled order as a long-running pool has them) in two ways:

* one layer's cache, called again and again: what the kernel costs when its data is in cache;
* `--layers` distinct caches in turn, as a step's layers are: what it costs from DRAM;

and beside them the box's streaming read rate (a torch sum over a buffer far larger than
the caches), so the second figure can be read as a fraction of what the memory gives.

With `--queries N` (N > 1) it times the prompt kernel instead: each sequence's last N
positions as one prompt step over its `--context` keys (N == context: a whole prompt),
against torch's fused attention on the same keys gathered as the torch path gathers them,
in ms a layer and multiply-adds a second (the causal half only).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from duplex.bench.report import write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="decoding sequences")
    parser.add_argument("--context", type=int, default=129, help="keys each sequence sees")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30, help="distinct caches in turn")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--stream-mb", type=int, default=400,
                        help="buffer size for the streaming read rate")
    parser.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the caches' element type")
    parser.add_argument("--queries", type=int, default=1,
                        help="1: decode; N > 1: each sequence's last N positions as a prompt "
                             "step (the C prompt kernel beside torch's fused attention)")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: the kernel as built for a CPU without AVX-512 (the 8-lane "
                             "walk most laptops run), timed on this one")
    parser.add_argument("--out", default=None, help="write the JSON result here")


def paged_batch(args, seed: int = 0):
    """q [B, H, D], `layers` (k, v) caches [blocks, block_size, KVH, D] and the key slots
    [B, context] of sequences whose blocks lie in a shuffled order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-args.context // args.block_size)
    blocks = args.batch * per_seq
    shape = (blocks, args.block_size, args.kv_heads, args.head_dim)
    dtype = getattr(torch, getattr(args, "kv_dtype", "float32"))
    caches = [(torch.randn(shape, generator=gen).to(dtype),
               torch.randn(shape, generator=gen).to(dtype)) for _ in range(args.layers)]
    order = torch.randperm(blocks, generator=gen).view(args.batch, per_seq)
    pos = torch.arange(args.context)
    keys = (order[:, pos // args.block_size] * args.block_size + pos % args.block_size).contiguous()
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=gen)
    return q, caches, keys


def time_layers(q, caches, keys, repeats: int, rotate: bool) -> list[float]:
    """Seconds a layer: each repeat runs len(caches) calls, on distinct caches when rotate."""
    import torch

    from duplex.kernels import cpu_attention

    counts = torch.full((keys.shape[0],), keys.shape[1], dtype=torch.long)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(len(caches)):
            k, v = caches[i if rotate else 0]
            cpu_attention.decode(q, k, v, None, keys, counts, q.shape[-1] ** -0.5)
        times.append((time.perf_counter() - start) / len(caches))
    return times


def run(args: argparse.Namespace) -> int:
    import torch

    from duplex.bench.machine import memory_read_gbs
    from duplex.kernels import cpu_attention

    if not cpu_attention.available():
        print("the CPU attention kernel does not run here "
              "(no C compiler, or neither AVX-512 nor AVX2 + FMA)")
        return 1
    if args.isa == "avx2" and not cpu_attention.use_avx2_build():
        print("the AVX2 build does not run here (no AVX2 and FMA, or it did not build)")
        return 1
    if args.queries > 1:
        return run_prompts(args)
    q, caches, keys = paged_batch(args)
    kv_bytes = 2 * keys.numel() * args.kv_heads * args.head_dim * caches[0][0].element_size()
    cached = statistics.median(time_layers(q, caches, keys, args.repeats, rotate=False))
    dram = statistics.median(time_layers(q, caches, keys, args.repeats, rotate=True))
    stream = memory_read_gbs(args.stream_mb * (1 << 20))
    result = {"command": "duplex bench attention", "args": vars(args),
              "torch_threads": torch.get_num_threads(), "kv_mb_per_layer": kv_bytes / 1e6,
              "cached_ms": cached * 1e3, "rotating_ms": dram * 1e3,
              "rotating_gbs": kv_bytes / dram / 1e9, "stream_read_gbs": stream}
    return report(args, result, markdown(result))


def report(args: argparse.Namespace, result: dict, text: str) -> int:
    """Print the table, write the JSON where asked."""
    print(text)
    if args.out:
        write_json(Path(args.out), result)
    return 0


def time_prompts(args, q, cache, keys) -> tuple[float, float]:
    """Medians of a layer's seconds over the batch's prompt steps: the C kernel, torch's."""
    import torch

    from duplex.kernels import cpu_attention

    k, v = cache
    queries, context, scale = args.queries, args.context, args.head_dim ** -0.5
    out = torch.empty(args.batch, queries, args.heads, args.head_dim)
    pos = torch.arange(context - queries, context)[:, None]
    mask = None if queries == context else (torch.arange(context)[None] <= pos)[None, None]
    slots_k, slots_v = (c.view(-1, args.kv_heads, args.head_dim) for c in (k, v))

    def kernel():
        for b in range(args.batch):
            cpu_attention.prefill(q[b], k, v, keys[b], scale, out[b])

    def fused():  # what kernels.attention does per prompt: gather, widen, fused attention
        for b in range(args.batch):
            kk, vv = (s.index_select(0, keys[b]).float().transpose(0, 1)[None]
                      for s in (slots_k, slots_v))
            torch.nn.functional.scaled_dot_product_attention(
                q[b].transpose(0, 1)[None], kk, vv, attn_mask=mask, scale=scale,
                is_causal=mask is None, enable_gqa=True)

    times = {kernel: [], fused: []}
    for f in (kernel, fused):
        f()  # warm
    for _ in range(args.repeats):
        for f in (kernel, fused):  # in turns
            start = time.perf_counter()
            f()
            times[f].append(time.perf_counter() - start)
    return statistics.median(times[kernel]), statistics.median(times[fused])


def run_prompts(args: argparse.Namespace) -> int:
    import torch

    from duplex.kernels import cpu_attention

    if not cpu_attention.prefill_available():
        print("the C prompt attention does not run here (AVX-512, or AVX2 and FMA)")
        return 1
    if not 1 < args.queries <= args.context:
        raise SystemExit("--queries must be 2 .. --context")
    args.layers = 1
    _, caches, keys = paged_batch(args)
    q = torch.randn(args.batch, args.queries, args.heads, args.head_dim,
                    generator=torch.Generator().manual_seed(1))
    c_s, torch_s = time_prompts(args, q, caches[0], keys)
    Q, L = args.queries, args.context
    macs = args.batch * args.heads * args.head_dim * 2 * (Q * L - Q * (Q - 1) / 2)
    result = {"command": "duplex bench attention", "args": vars(args),
              "torch_threads": torch.get_num_threads(), "kernel_ms": c_s * 1e3,
              "torch_ms": torch_s * 1e3, "kernel_gmacs": macs / c_s / 1e9,
              "torch_gmacs": macs / torch_s / 1e9}
    return report(args, result, markdown_prompts(result))


def markdown_prompts(r: dict) -> str:
    a = r["args"]
    return "\n".join([
        f"prompt attention, {a['batch']} sequences x the last {a['queries']} of {a['context']} "
        f"positions, {a['heads']} heads / {a['kv_heads']} kv heads x {a['head_dim']}, "
        f"{a.get('kv_dtype', 'float32')} KV, {r['torch_threads']} threads; a layer:",
        "",
        "| C prompt kernel | torch's fused attention | kernel / torch time |",
        "|---|---|---|",
        f"| {r['kernel_ms']:.2f} ms ({r['kernel_gmacs']:.1f} G multiply-adds/s) | "
        f"{r['torch_ms']:.2f} ms ({r['torch_gmacs']:.1f} G/s) | "
        f"{r['kernel_ms'] / r['torch_ms']:.2f} |",
    ])


def markdown(r: dict) -> str:
    a = r["args"]
    return "\n".join([
        f"decode attention, {a['batch']} sequences x {a['context']} keys, {a['heads']} heads / "
        f"{a['kv_heads']} kv heads x {a['head_dim']}, {a.get('kv_dtype', 'float32')} KV "
        f"({r['kv_mb_per_layer']:.1f} MB a "
        f"layer), {r['torch_threads']} threads",
        "",
        "| one layer's cache, again | distinct caches in turn | read rate from DRAM | "
        "the box's streaming read |",
        "|---|---|---|---|",
        f"| {r['cached_ms']:.3f} ms | {r['rotating_ms']:.3f} ms | {r['rotating_gbs']:.1f} GB/s | "
        f"{r['stream_read_gbs']:.1f} GB/s |",
    ])
