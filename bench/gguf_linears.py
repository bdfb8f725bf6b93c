"""`duplex bench gguf-linears`: one layer's linears of a GGUF file, alone, through each path a
step can send them down (kernels/gguf_weight.py), at the row counts asked for:

* int8-rows: the row kernels on int8 activations (`cpu_gguf.linear`: the row loop, AVX-512
  VNNI with weight rows or rows of x in the lanes, AMX-INT8 tiles), which decode steps take
  (Q4_0 / Q4_1 weights of small files with the VNNI int4 layout take kernels/cpu_qgemv.c
  instead);
* int8-rows-xl-off: at the row counts where a layer of K-quants takes the kernel with rows of
  x in the lanes (`cpu_gguf.xl_takes`), the same with it switched off (DUPLEX_GGUF_XL16=0):
  what those rows take without it (from 8 rows the kernel with weight rows in the lanes,
  which gives the same bits; below, the row loop);
* int8-rows-x8-off: on AVX2 without AVX-512 VNNI, at the row counts where K-quants take the
  kernel with 8 rows of x in the lanes (`cpu_gguf.X8_ROWS` and more), the same with it
  switched off (DUPLEX_GGUF_X8=0): the row loop;
* prompt: the prompt GEMM on dequantized blocks (`GGUFWeight._tiled`): the bf16 GEMM on the
  file's blocks (`cpu_gguf.gemm_bf16`: AMX-BF16 tiles or AVX512-BF16), else fp32 tiles. Where
  prompt steps take int8 activations (`GGUFWeight.int8_prompt`: K-quants on AVX-512 VNNI
  without AMX, or on AVX2), they run int8-rows' lanes kernel instead;
* prompt-onednn: where the CPU has a bf16 GEMM on the blocks, the same product with it
  switched off (DUPLEX_GGUF_AMX=0, DUPLEX_GGUF_BF16_GEMM=0): weights dequantized to bf16 in
  chunks for oneDNN's GEMM, in blocks of 64 or 128 rows.

The paths take turns, round after round, so a box whose speed drifts (a shared VM's memory
rate does) moves them alike; each figure is the median over rounds of one pass through all of
the layer's linears, in ms, and its arithmetic rate (2 m n k a linear) beside the CPU's own
limit where the path's kernel is built on one instruction: the prompt GEMM on AVX512-BF16
against vdpbf16ps issued back to back, the int8 rows on AVX-512 VNNI (no AMX) against
vpdpbusd; on an AVX2-only CPU the fp32 prompt tiles against 256-bit vfmadd231ps and the int8
row loop against AVX2's int8 dot, vpmaddubsw + vpmaddwd + vpaddd (`cpu_gguf.peak_ops`,
measured first; the kernel with rows of x in the lanes sums in int16 between vpmaddwd, so
that dot does not bound it and its rows get no share).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from duplex.bench.report import write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="GGUF file (default: the default model)")
    parser.add_argument("--layer", type=int, default=0, help="whose linears (blk.N.*)")
    parser.add_argument("--rows", default="1,16,64,512", help="row counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="turns of every path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the JSON result here")


def layer_weights(path: str, layer: int) -> list[tuple[str, int, torch.Tensor, int]]:
    """(name, ggml type, raw uint8 [N, row_bytes], K) of blk.{layer}'s 2-D weights."""
    from gguf import GGUFReader

    from duplex.kernels import cpu_gguf

    found = []
    for t in GGUFReader(path).tensors:
        if (t.name.startswith(f"blk.{layer}.") and t.name.endswith(".weight")
                and len(t.shape) == 2 and int(t.tensor_type) in cpu_gguf.TYPES):
            n, k = int(t.shape[1]), int(t.shape[0])
            raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(n, -1))
            found.append((t.name, int(t.tensor_type), raw, k))
    if not found:
        raise SystemExit(f"{path}: no 2-D weights of a supported type in blk.{layer}")
    return found


def paths(weights, m: int) -> dict[str, Callable[[], None]]:
    """name -> one pass through the weights at m rows."""
    from duplex.kernels import cpu_gguf
    from duplex.kernels.gguf_weight import GGUFWeight

    lib = cpu_gguf._load()
    g = torch.Generator().manual_seed(m)
    cases = [(GGUFWeight(type_id, raw, k), type_id, raw, k, torch.randn(m, k, generator=g))
             for _, type_id, raw, k in weights]
    for case in cases:
        case[0].pack()

    def int8_rows():
        for _, type_id, raw, k, x in cases:
            cpu_gguf.linear(type_id, raw, k, x)

    def prompt():
        for w, *_, x in cases:
            w._tiled(x)

    def int8_rows_x8_off():
        lib.gg_set_x8(0)
        try:
            int8_rows()
        finally:
            cpu_gguf.apply_amx_switch(lib)

    def int8_rows_xl_off():
        lib.gg_set_xl(0)
        try:
            int8_rows()
        finally:
            cpu_gguf.apply_amx_switch(lib)

    def onednn():
        for name in ("gg_set_amx", "gg_set_bf16_gemm"):
            if hasattr(lib, name):
                getattr(lib, name)(0)
        try:
            prompt()
        finally:
            cpu_gguf.apply_amx_switch(lib)

    found = {"prompt": prompt}
    if cpu_gguf.available():
        found["int8-rows"] = int8_rows
        k_quants = all(cpu_gguf.TYPES[type_id][1] == 256 for _, type_id, _, _ in weights)
        if k_quants and cpu_gguf.xl_takes(m):
            found["int8-rows-xl-off"] = int8_rows_xl_off
        if k_quants and cpu_gguf.x8_available() and m >= cpu_gguf.X8_ROWS:
            found["int8-rows-x8-off"] = int8_rows_x8_off
    if cpu_gguf.bf16_gemm_kind() is not None:
        found["prompt-onednn"] = onednn
    return found


def avx2_only() -> bool:
    """An x86 CPU with AVX2 and FMA and no AVX-512 (most laptops, the Zen 1 box of
    docs/BENCHMARKS.md): its row kernels are built on vpmaddubsw + vpmaddwd, its prompt tiles
    on torch's 256-bit fp32 FMAs."""
    from duplex.kernels.cpu_fused import cpu_flags

    flags = cpu_flags()
    return b" avx2" in flags and b" fma" in flags and b" avx512f" not in flags


def peaks(threads: int, weights, tries: int = 3) -> dict[str, float]:
    """The CPU's limit (ops/s, the best of `tries` probes) for each path whose kernel one
    instruction bounds here: the prompt GEMM on AVX512-BF16, the int8 rows on AVX-512 VNNI
    with weight rows in the lanes (K-quants only, VN_ROWS rows and more, no AMX); on an
    AVX2-only CPU the fp32 prompt tiles (256-bit FMA) and the int8 rows (AVX2's int8 dot)."""
    from duplex.kernels import cpu_gguf, gguf_weight

    kinds = {}
    if cpu_gguf.bf16_gemm_kind() == "avx512":
        kinds["prompt"] = "bf16"
    elif avx2_only() and gguf_weight.prompt_gemm_dtype() == torch.float32:
        kinds["prompt"] = "fp32-256"
    k_quants = all(cpu_gguf.TYPES[type_id][1] == 256 for _, type_id, _, _ in weights)
    if k_quants and cpu_gguf.vn_available() and not cpu_gguf.amx_available():
        kinds["int8-rows"] = "int8"
    elif avx2_only() and all(cpu_gguf.TYPES[type_id][1] >= 32 for _, type_id, _, _ in weights):
        kinds["int8-rows"] = "int8-avx2"  # block types only: F16 / BF16 / F32 rows are fp32 dots
    found = {name: max(cpu_gguf.peak_ops(kind, threads) or 0.0 for _ in range(tries))
             for name, kind in kinds.items()}
    return {name: rate for name, rate in found.items() if rate > 0}


def rate_text(name: str, m: int, ms: float, gops: float, limits: dict[str, float]) -> str:
    from duplex.kernels import cpu_gguf

    text = f"{name} {ms:8.2f} ms {gops:5.0f} G/s"
    kind = name.removesuffix("-xl-off").removesuffix("-x8-off")  # the same instruction's limit
    x8 = name == "int8-rows" and cpu_gguf.x8_available() and m >= cpu_gguf.X8_ROWS
    bounded = kind in limits and not x8 and (kind != "int8-rows" or m >= cpu_gguf.VN_ROWS
                                             or avx2_only())
    return text + (f" ({gops * 1e9 / limits[kind]:4.0%})" if bounded else "")


def run(args: argparse.Namespace) -> int:
    from duplex.engine.config import default_model_path
    from duplex.kernels import cpu_gguf

    torch.set_num_threads(args.threads)
    model = args.model or str(default_model_path())
    weights = layer_weights(model, args.layer)
    result = {"model": model, "layer": args.layer, "threads": args.threads,
              "bf16_gemm": cpu_gguf.bf16_gemm_kind(), "rounds": args.rounds,
              "weights": [(name, cpu_gguf.TYPES[t][0], raw.shape[0], k)
                          for name, t, raw, k in weights], "ms": {}}
    print(f"{model} blk.{args.layer}: {len(weights)} linears, {args.threads} threads, "
          f"bf16 GEMM on the blocks: {result['bf16_gemm'] or 'none'}")
    limits = result["peak_gops"] = peaks(args.threads, weights)
    if limits:
        print("CPU limit, the kernel's instruction back to back: " + ", ".join(
            f"{name} {rate / 1e9:.0f} G/s" for name, rate in limits.items())
            + "; (%): each figure's share of it")
    result["gops"] = {}
    macs = sum(raw.shape[0] * k for _, _, raw, k in weights)
    for m in (int(v) for v in args.rows.split(",")):
        fns = paths(weights, m)
        for fn in fns.values():
            fn()  # warm: packing, scratch buffers, oneDNN's kernel choice
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
        result["ms"][m] = {name: statistics.median(t) for name, t in times.items()}
        result["gops"][m] = {name: 2 * m * macs / ms / 1e6 for name, ms in result["ms"][m].items()}
        print(f"rows {m:5d}: " + "  ".join(rate_text(name, m, ms, result["gops"][m][name], limits)
                                           for name, ms in result["ms"][m].items()), flush=True)
    if args.out:
        print(f"wrote {write_json(Path(args.out), result)}")
    return 0
