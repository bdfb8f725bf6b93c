"""`duplex bench attention`: the CPU decode-attention kernel alone, against the box's memory.

A batch-64 decode step reads every sequence's keys and values once a layer. This times
kernels/cpu_attention.c at a decode step's own shapes (SmolLM2's heads by default, paged
blocks in a shuffled order as a long-running pool has them) in two ways:

* one layer's cache, called again and again: what the kernel costs when its data is in cache;
* `--layers` distinct caches in turn, as a step's layers are: what it costs from DRAM;

and beside them the box's streaming read rate (a torch sum over a buffer far larger than
the caches), so the second figure can be read as a fraction of what the memory gives.
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
        print("the CPU attention kernel does not run here (no C compiler or no AVX-512)")
        return 1
    q, caches, keys = paged_batch(args)
    kv_bytes = 2 * keys.numel() * args.kv_heads * args.head_dim * caches[0][0].element_size()
    cached = statistics.median(time_layers(q, caches, keys, args.repeats, rotate=False))
    dram = statistics.median(time_layers(q, caches, keys, args.repeats, rotate=True))
    stream = memory_read_gbs(args.stream_mb * (1 << 20))
    result = {"command": "duplex bench attention", "args": vars(args),
              "torch_threads": torch.get_num_threads(), "kv_mb_per_layer": kv_bytes / 1e6,
              "cached_ms": cached * 1e3, "rotating_ms": dram * 1e3,
              "rotating_gbs": kv_bytes / dram / 1e9, "stream_read_gbs": stream}
    print(markdown(result))
    if args.out:
        write_json(Path(args.out), result)
    return 0


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
