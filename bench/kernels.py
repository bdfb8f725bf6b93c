"""Time each triton kernel against torch eager on CUDA: `duplex bench kernels`
(or `python -m duplex.bench.kernels`).

Not for CPU: the interpreter says nothing about speed. Returns (and prints) a dict
`{kernel: {"triton_ms": ..., "torch_ms": ..., "speedup": ...}}` over SmolLM2-ish and
Llama-8B-ish shapes.
"""
import json

import torch

from duplex.kernels import attention, kv_store, matmul, rms_norm, rotary


def bench_all(dtype: torch.dtype = torch.bfloat16) -> dict:
    assert torch.cuda.is_available(), "duplex.bench.kernels times CUDA kernels; no CUDA device here"
    cases = {
        "store_kv": _store_kv_case(dtype),
        "rms_norm_residual": _rms_norm_case(dtype),
        "rotary": _rotary_case(dtype),
        "linear_batch_invariant": _linear_case(dtype),
        "paged_attention_decode": _attention_case(dtype, [(2048, 1)] * 64),
        "paged_attention_prefill": _attention_case(dtype, [(2048, 512)] * 4),
    }
    return {name: _compare(*fns) for name, fns in cases.items()}


def _time_ms(fn, iters: int = 50) -> float:
    """Median of CUDA-event timings after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _compare(triton_fn, torch_fn) -> dict:
    triton_ms, torch_ms = _time_ms(triton_fn), _time_ms(torch_fn)
    return {"triton_ms": triton_ms, "torch_ms": torch_ms, "speedup": torch_ms / triton_ms}


def _store_kv_case(dtype):
    k, v = (torch.randn(4096, 8, 128, device="cuda", dtype=dtype) for _ in range(2))
    k_cache, v_cache = (torch.zeros(4096, 16, 8, 128, device="cuda", dtype=dtype)
                        for _ in range(2))
    slots = torch.randperm(4096 * 16, device="cuda")[:4096]
    args = (k, v, k_cache, v_cache, slots)
    return (lambda: kv_store.store_kv_triton(*args), lambda: kv_store.store_kv_ref(*args))


def _rms_norm_case(dtype):
    x, residual = (torch.randn(4096, 4096, device="cuda", dtype=dtype) for _ in range(2))
    weight = torch.randn(4096, device="cuda", dtype=dtype)
    return (lambda: rms_norm.rms_norm_triton(x, weight, 1e-6, residual),
            lambda: rms_norm.rms_norm_ref(x, weight, 1e-6, residual))


def _rotary_case(dtype):
    cache = rotary.rope_cos_sin_cache(128, 8192).cuda()
    positions = torch.randint(0, 8192, (4096,), device="cuda")
    q = torch.randn(4096, 32, 128, device="cuda", dtype=dtype)
    k = torch.randn(4096, 8, 128, device="cuda", dtype=dtype)
    return (lambda: rotary.rotary_embedding_triton(positions, q, k, cache),
            lambda: rotary.rotary_embedding_ref(positions, q, k, cache))


def _linear_case(dtype):
    x = torch.randn(256, 4096, device="cuda", dtype=dtype)
    weight = torch.randn(14336, 4096, device="cuda", dtype=dtype)
    return (lambda: matmul.linear_triton(x, weight), lambda: matmul.linear_ref(x, weight))


def _attention_case(dtype, seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16):
    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in seqs]
    shape = (sum(blocks_per_seq), block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
    block_tables = torch.randperm(shape[0], device="cuda", dtype=torch.int64)
    block_tables = block_tables[:len(seqs) * max(blocks_per_seq)].view(len(seqs), -1).int()
    q_lens = torch.tensor([q_len for _, q_len in seqs])
    query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int().cuda()
    seq_lens = torch.tensor([seq_len for seq_len, _ in seqs], dtype=torch.int32, device="cuda")
    q = torch.randn(int(q_lens.sum()), num_heads, head_dim, device="cuda", dtype=dtype)
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, head_dim ** -0.5)
    return (lambda: attention.paged_attention_triton(*args),
            lambda: attention.paged_attention_ref(*args))


def add_arguments(parser) -> None:
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        default="bfloat16", help="dtype of every kernel's inputs")


def run(args) -> int:
    print(json.dumps(bench_all(getattr(torch, args.dtype)), indent=2))
    return 0


if __name__ == "__main__":
    import argparse

    _parser = argparse.ArgumentParser(prog="python -m duplex.bench.kernels")
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
