"""`duplex bench gpu` (or `python -m duplex.bench.gpu_check`): the GPU check of issue 17, one command
that ends inside a time budget (default 330 s, for one H200), each section timed and guarded
so one failure does not stop the others:

    probes           device copy bandwidth (bytes read + written) and bf16 matmul TFLOP/s
    pytest_gpu       `pytest -m gpu -q` on the test files with gpu marks (a subprocess, run
                     beside the correctness sections, waited for before any timing)
    greedy           tiny random Llama, Qwen3, Gemma 3, Mixtral, DeepSeek-V3 saved with
                     save_pretrained: engine greedy tokens equal to transformers' (fp32,
                     TF32 off, same device), and bf16 engine agreement within BF16_TOLERANCE
    batch_invariant  bench.invariance's experiment with batch_invariant=True: bitwise
    sync_debug       torch.cuda.set_sync_debug_mode around decode steps: where they sync
    decode           decode ms/step at batch 1 and 64, context 128 and 2,048, SmolLM2-135M and
                     Llama-8B shapes (random bf16 weights, no download), beside the floor
                     (weight bytes + KV bytes read) / measured copy bandwidth; then the same
                     cells replayed from CUDA graphs (engine/cuda_graphs.py)
    kernels          kernels.decode_attention / kernels.attention against torch SDPA (flash)
                     on contiguous KV of the same shapes, and FlashInfer where importable;
                     kernels.mla_decode against its torch path on DeepSeek-V3's latent

Results go to `--out DIR` (default $OUT, else ./out/gpu_check) as gpu_check.json and
gpu_check.md. `--device cpu --quick` runs it end to end on a CPU box with tiny shapes (the
CUDA-only sections say "skipped: no CUDA"), which is how tests/bench check it. Nothing is
fetched from a hub: every model is built from a config with random weights.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("probes", "pytest_gpu", "greedy", "batch_invariant", "sync_debug", "decode",
            "kernels")
CUDA_ONLY = ("pytest_gpu", "sync_debug", "kernels")
# bf16 is judged against transformers' own bf16 run, both compared with the fp32 reference
# by the share of generated tokens before each prompt's first difference: on these tiny
# random models transformers' bf16 keeps only 30-81 % (CPU, 4 prompts x 16 tokens), so a
# fixed share would fail for rounding alone. The engine passes when its share is at most
# this much below transformers'; logprob gaps on the agreeing prefix are reported beside
# transformers' own, not judged.
BF16_TOLERANCE = dict(max_agreement_shortfall=0.15)
GREEDY_PROMPT_LENS = (5, 17, 40, 3, 29, 11, 48, 8, 23, 36, 4, 14, 31, 19, 44, 6)
FP32_LOGPROB_ATOL = 1e-3  # the CPU equality tests' tolerance (tests/engine/test_tiny_models.py)

# ---------------------------------------------------------------------------- model shapes
# HF LlamaConfig fields; random weights (std 0.02, norms 1). Llama-8B: Llama-3.1-8B's shape
# without its rope scaling and with 8,192 positions (the check never goes past 2,100).
SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=False),
    # --quick: tiny, but a vocabulary over bench.invariance's token range (200-20000)
    "tiny": dict(vocab_size=20480, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}

# tiny random checkpoints for the greedy comparison (as tests/engine, tests/moe and
# tests/models_swa build them): spread init (0.3) keeps argmax and top-k far from ties
TINY_VOCAB = 384
_TINY_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False)
TINY_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
        rope_theta=5000.0, rope_local_base_freq=100.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=96, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=48,
        first_k_dense_replace=1, routed_scaling_factor=2.5, num_key_value_heads=4)),
}


# ---------------------------------------------------------------------------- the run
class Budget:
    """Seconds left of the whole check's time budget."""

    def __init__(self, total_s: float) -> None:
        self.total_s, self.start = total_s, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()


class Check:
    """What every section reads: the arguments, the platform, the budget and the probes."""

    def __init__(self, args: argparse.Namespace) -> None:
        from duplex.engine.platform import resolve

        self.args = args
        self.quick = args.quick
        self.platform = resolve(args.device)
        self.device = self.platform.device
        self.is_cuda = self.platform.is_cuda
        self.budget = Budget(args.budget_s)
        self.out = Path(args.out)
        self.bandwidth_gbs: float | None = None  # from the probes; floors need them
        self.bf16_tflops: float | None = None
        self.pytest_proc: subprocess.Popen | None = None
        self.pytest_started_s = 0.0
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))


def run_section(check: Check, name: str, fn: Callable[[Check], dict]) -> dict:
    """Run one section: timed, guarded, skipped once the budget is spent."""
    if name in CUDA_ONLY and not check.is_cuda:
        return dict(status="skipped: no CUDA", seconds=0.0)
    if check.budget.left() <= 0 and fn is not wait_pytest:  # a started pytest is reaped
        return dict(status=f"skipped: time budget ({check.args.budget_s:.0f} s) spent",
                    seconds=0.0)
    start = time.perf_counter()
    try:
        result = fn(check)
        status = result.pop("status", "ok")
    except Exception as error:  # one failing section must not stop the others
        result = dict(error=f"{type(error).__name__}: {error}",
                      traceback=traceback.format_exc(limit=12))
        status = "error"
    finally:
        gc.collect()  # the section's engines and tensors, before the next one sizes memory
        if check.is_cuda:
            torch.cuda.empty_cache()
    result.update(status=status, seconds=round(time.perf_counter() - start, 2))
    print(f"[gpu_check] {name}: {status} in {result['seconds']:.1f} s "
          f"({check.budget.elapsed():.0f} s of {check.args.budget_s:.0f})", flush=True)
    return result


def main_sections() -> list[tuple[str, Callable[[Check], dict]]]:
    """In run order: probes on a quiet device, pytest started beside the correctness
    sections and waited for before the timed ones."""
    return [("probes", probes), ("pytest_gpu", start_pytest), ("greedy", greedy),
            ("batch_invariant", batch_invariant), ("sync_debug", sync_debug),
            ("pytest_gpu", wait_pytest), ("decode", decode), ("kernels", kernel_bench)]


def run_all(args: argparse.Namespace, on_section: Callable[[dict], None] | None = None
            ) -> dict:
    """The report; `on_section(report so far)` after each section (so that a run killed
    from outside still leaves the sections it finished on disk)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the log is the device's reply
    check = Check(args)
    if check.is_cuda:  # the fp32 comparisons are exact only without TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    results: dict[str, dict] = {}
    try:
        run_sections(check, only, results, on_section)
    finally:
        if check.pytest_proc is not None and check.pytest_proc.poll() is None:
            os.killpg(check.pytest_proc.pid, 9)  # never leave it holding the device
    return report_of(check, results)


def run_sections(check: Check, only: set[str], results: dict[str, dict],
                 on_section: Callable[[dict], None] | None) -> None:
    for name, fn in main_sections():
        if name not in only:
            results.setdefault(name, dict(status="skipped: not in --only", seconds=0.0))
            continue
        if fn is wait_pytest:
            if results.get(name, {}).get("status") != "started":
                continue  # skipped (no CUDA, no budget) or failed to start
            results[name] = {**run_section(check, name, fn),
                             "started_s": results[name]["started_s"]}
        else:
            results[name] = run_section(check, name, fn)
        if on_section is not None:
            on_section(report_of(check, results))


def report_of(check: Check, results: dict[str, dict]) -> dict:
    pending = dict(status="not run (the check stopped before it)", seconds=0.0)
    return dict(meta=meta(check), sections={name: results.get(name, pending)
                                            for name in SECTIONS})


def meta(check: Check) -> dict:
    import transformers

    info = dict(device=str(check.device), quick=check.quick, budget_s=check.args.budget_s,
                elapsed_s=round(check.budget.elapsed(), 1), torch=torch.__version__,
                transformers=transformers.__version__, python=sys.version.split()[0],
                tf32=torch.backends.cuda.matmul.allow_tf32,
                bf16_tolerance=BF16_TOLERANCE, date=time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                  time.gmtime()))
    if check.is_cuda:
        props = torch.cuda.get_device_properties(check.device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count)
    with contextlib.suppress(ImportError):
        import triton
        info["triton"] = triton.__version__
    return info


# ---------------------------------------------------------------------------- timing
def time_ms(fn: Callable[[], Any], device: torch.device, iters: int = 20,
            warmup: int = 3) -> float:
    """Median milliseconds of fn: CUDA events on a GPU, the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---------------------------------------------------------------------------- (a) probes
def probes(check: Check) -> dict:
    """Copy bandwidth (a large device-to-device copy, bytes read + written) and the bf16
    matmul rate on random data (never zeros: they run faster)."""
    dev = check.device
    copy_bytes = (32 if check.quick else 4096) * 2**20
    src = torch.randn(copy_bytes // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), dev, iters=5 if check.quick else 20)
    n = 256 if check.quick else 8192
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    mm_ms = time_ms(lambda: a @ b, dev, iters=3 if check.quick else 10)
    check.bandwidth_gbs = 2 * copy_bytes / (copy_ms / 1e3) / 1e9
    check.bf16_tflops = 2 * n**3 / (mm_ms / 1e3) / 1e12
    return dict(copy_bytes=copy_bytes, copy_ms=copy_ms, copy_gbs=check.bandwidth_gbs,
                matmul_n=n, matmul_ms=mm_ms, bf16_tflops=2 * n**3 / (mm_ms / 1e3) / 1e12,
                summary=f"copy {check.bandwidth_gbs:.0f} GB/s (read+write), bf16 matmul "
                        f"{2 * n**3 / (mm_ms / 1e3) / 1e12:.1f} TFLOP/s at {n}^3")


# ---------------------------------------------------------------------------- (b) pytest
def gpu_test_files() -> list[str]:
    """Test files with a gpu mark (collecting only these keeps modules whose imports a GPU
    box lacks, such as the browser tests, out of the run)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text())


def start_pytest(check: Check) -> dict:
    files = gpu_test_files()
    log = open(check.out / "pytest_gpu.log", "w")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", *files]
    check.pytest_proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
    check.pytest_started_s = check.budget.elapsed()
    return dict(status="started", started_s=round(check.pytest_started_s, 1), files=files)


def wait_pytest(check: Check) -> dict:
    proc = check.pytest_proc
    ran_s = check.budget.elapsed() - check.pytest_started_s
    timeout = max(5.0, min(check.args.pytest_timeout_s - ran_s, check.budget.left()))
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        rc = None
    text = (check.out / "pytest_gpu.log").read_text(errors="replace")
    tail = "\n".join(text.strip().splitlines()[-15:])
    counts = {kind: int(n) for n, kind in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", tail)}
    status = "ok" if rc == 0 else f"fail (exit {rc})" if rc is not None else \
        f"fail (timed out after {ran_s + timeout:.0f} s)"
    return dict(status=status, returncode=rc, counts=counts, tail=tail,
                summary=", ".join(f"{n} {k}" for k, n in counts.items()) or tail[-200:])


# ---------------------------------------------------------------------------- engines
def make_engine(model_path: str, platform, **kwargs):
    """The one place this check builds an EngineCore, from flat EngineConfig field names
    (model, num_kv_blocks, max_num_seqs, max_num_batched_tokens, weights_dtype,
    batch_invariant, enable_prefix_caching, block_size): adapt it here when the config
    changes. num_kv_blocks is always given, so a GPU's pool is not sized to 90 % of memory."""
    from duplex.engine.config import EngineConfig
    from duplex.engine.core import EngineCore

    kwargs.setdefault("num_kv_blocks", 512)
    # main's sectioned config routes flat names through EngineConfig.of; a flat one takes them
    build = getattr(EngineConfig, "of", EngineConfig)
    return EngineCore(build(model=model_path, **kwargs), progress=False, platform=platform)


def run_requests(core, prompts: list[list[int]], params, arrivals: list[int] | None = None
                 ) -> list[tuple[list[int], list[float]]]:
    """Each prompt's (tokens, logprobs), prompt i added before step arrivals[i]."""
    from duplex.bench.invariance import run_jobs

    arrivals = arrivals or [0] * len(prompts)
    out = run_jobs(core, [(f"r{i}", p, params, a)
                          for i, (p, a) in enumerate(zip(prompts, arrivals))])
    return [out[f"r{i}"] for i in range(len(prompts))]


def write_shape_dir(root: Path, name: str) -> Path:
    """A model directory holding only the config.json of one SHAPES entry."""
    import transformers

    path = root / f"shape-{name}"
    transformers.LlamaConfig(**SHAPES[name]).save_pretrained(path)
    return path


@contextlib.contextmanager
def random_weights(device: torch.device, dtype: torch.dtype, seed: int = 0):
    """While inside, the engine's loader builds random weights on `device` from a model
    directory's config.json (no weight files): std 0.02, norm weights 1, the same for every
    load of one seed. Yields a dict that gets `weight_bytes` (what a decode step reads: every
    weight but an untied embedding table) of the last load. Patches `engine.core.load`."""
    from duplex.engine import core as core_module
    from duplex.engine.models.loader import LoadedModel, hf_config_to_args

    info: dict[str, int] = {}

    def load(path, load_dtype=dtype, progress=False, quant="none"):
        config = json.loads((Path(path) / "config.json").read_text())
        state = random_state_dict(config, device, dtype, seed)
        info["weight_bytes"] = sum(t.numel() * t.element_size() for name, t in state.items()
                                   if name != "model.embed_tokens.weight"
                                   or config.get("tie_word_embeddings"))
        return LoadedModel(hf_config_to_args(config), state, f"random-{seed}", Path(path).name)

    original = core_module.load
    core_module.load = load
    try:
        yield info
    finally:
        core_module.load = original


def random_state_dict(config: dict, device: torch.device, dtype: torch.dtype,
                      seed: int) -> dict[str, torch.Tensor]:
    """HF parameter names and shapes of `config`'s model (built on the meta device), filled
    with random values on `device`."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    gen = torch.Generator(device).manual_seed(seed)
    state = {}
    for name, meta_tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # saved checkpoints leave the tied head out too
        if "norm" in name:
            state[name] = torch.ones(meta_tensor.shape, device=device, dtype=dtype)
        else:
            t = torch.empty(meta_tensor.shape, device=device, dtype=dtype)
            state[name] = t.normal_(0.0, 0.02, generator=gen)
    return state


# ---------------------------------------------------------------------------- (c) greedy
def build_tiny(root: Path, name: str) -> Path:
    """Save a tiny random checkpoint of TINY_MODELS[name] with save_pretrained."""
    import transformers

    config_name, model_name, extra = TINY_MODELS[name]
    config = getattr(transformers, config_name)(**{**_TINY_COMMON, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if name == "gemma3" and "norm" in param_name:  # (1 + 0) norms: give them weight
                p.normal_(0.0, 0.3)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # zeros after init
                buffer.normal_(0.0, 0.3)
    path = root / f"tiny-{name}"
    model.save_pretrained(path, safe_serialization=True)
    return path


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_new: int, device: torch.device
              ) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (no EOS stop) and each token's logprob, each step
    a full forward over the sequence so far (no cache API to depend on; tiny models)."""
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(num_new):
        logits = model(torch.tensor([ids], device=device)).logits[0, -1].float()
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return tokens, logprobs


def compare_runs(got: list[tuple[list[int], list[float]]],
                 ref: list[tuple[list[int], list[float]]]) -> dict:
    """Token equality, share of tokens before the first difference, logprob gap there."""
    agreeing, total, max_diff = 0, 0, 0.0
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, ref):
        n = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b),
                 min(len(tokens), len(ref_tokens)))
        agreeing, total = agreeing + n, total + len(ref_tokens)
        diffs = [abs(a - b) for a, b in zip(logprobs[:n], ref_logprobs[:n])]
        max_diff = max([max_diff, *diffs])
    return dict(equal=all(g[0] == r[0] for g, r in zip(got, ref)),
                token_agreement=agreeing / max(total, 1), max_logprob_diff=max_diff)


def compare_model(check: Check, name: str, prompts: list[list[int]], params,
                  arrivals: list[int], num_new: int) -> dict:
    """One tiny model: transformers' fp32 greedy reference, then the engine in fp32 (and
    bf16 on CUDA) on the same prompts in one mixed batch, compared with it."""
    from transformers import AutoModelForCausalLM

    path = build_tiny(check.tmp, name)
    dtypes = ["float32"] + (["bfloat16"] if check.is_cuda else [])
    hf_runs = {}
    for dtype in dtypes:
        hf = AutoModelForCausalLM.from_pretrained(  # eager: the same attention on any device
            path, dtype=getattr(torch, dtype), attn_implementation="eager").to(check.device)
        hf_runs[dtype] = [hf_greedy(hf.eval(), p, num_new, check.device) for p in prompts]
        del hf
    ref = hf_runs["float32"]
    row = {}
    for dtype in dtypes:
        core = make_engine(str(path), check.platform, weights_dtype=dtype,
                           num_kv_blocks=256, max_num_batched_tokens=32, block_size=8)
        row[dtype] = compare_runs(run_requests(core, prompts, params, arrivals), ref)
        del core
    fp32 = row["float32"]
    row["float32_pass"] = fp32["equal"] and fp32["max_logprob_diff"] <= FP32_LOGPROB_ATOL
    if "bfloat16" in row:
        row["hf_bfloat16"] = compare_runs(hf_runs["bfloat16"], ref)
        row["bfloat16_pass"] = row["bfloat16"]["token_agreement"] >= \
            row["hf_bfloat16"]["token_agreement"] - BF16_TOLERANCE["max_agreement_shortfall"]
    return row


def greedy(check: Check) -> dict:
    from duplex.engine.sampling_params import SamplingParams

    # 16 prompts: prefix agreement in bf16 is noisy (one early difference costs a prompt's
    # whole run), so the bf16 judgement needs more of them than fp32 equality does
    num_new, lens = (3, (5, 17)) if check.quick else (16, GREEDY_PROMPT_LENS)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=gen).tolist() for n in lens]
    arrivals = [i % 4 for i in range(len(prompts))]  # mixed prefill and decode steps
    params = SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True, logprobs=0)
    models, ok = {}, True
    for name in TINY_MODELS:
        if check.budget.left() < 20:
            models[name] = dict(status="skipped: time budget spent")
            continue
        start = time.perf_counter()
        try:  # one model's failure (a transformers path this version lacks) is its row's
            row = compare_model(check, name, prompts, params, arrivals, num_new)
        except Exception as error:
            row = dict(status=f"error: {type(error).__name__}: {str(error)[:300]}",
                       float32_pass=False, traceback=traceback.format_exc(limit=8))
        ok &= row["float32_pass"] and row.get("bfloat16_pass", True)
        models[name] = dict(row, seconds=round(time.perf_counter() - start, 2))
    done = [n for n, r in models.items() if "float32_pass" in r]
    return dict(status="ok" if ok and done else "fail", models=models, num_new=num_new,
                prompt_lens=list(lens), bf16_tolerance=BF16_TOLERANCE,
                fp32_logprob_atol=FP32_LOGPROB_ATOL,
                summary=f"fp32 equal on {sum(models[n]['float32_pass'] for n in done)}"
                        f"/{len(TINY_MODELS)} models" + (
                            f", bf16 within tolerance on "
                            f"{sum(models[n].get('bfloat16_pass', False) for n in done)}"
                            f"/{len(TINY_MODELS)}" if check.is_cuda else
                            " (bf16: CUDA only)"))


# ---------------------------------------------------------------------------- (d) invariance
def engine_dtype(check: Check) -> str:
    return "bfloat16" if check.is_cuda else "float32"


def batch_invariant(check: Check) -> dict:
    """duplex.bench.invariance's solo-vs-busy experiment on a random-weight SmolLM2-shaped model
    (tiny with --quick): with the mode on, every run must match its solo run bitwise."""
    from duplex.bench.invariance import experiment

    shape = "tiny" if check.quick else "smollm2-135m"
    path = write_shape_dir(check.tmp, shape)
    sizes = dict(num_targets=2, num_new=3, max_companions=1, rounds=1) if check.quick else \
        dict(num_targets=6, num_new=32, max_companions=12, rounds=2)
    dtype = engine_dtype(check)
    dtype_t = getattr(torch, dtype)

    def make_core(**kwargs):
        kwargs.setdefault("num_kv_blocks", 2048)
        return make_engine(str(path), check.platform, weights_dtype=dtype, **kwargs)

    out = {}
    with random_weights(check.device, dtype_t):
        for mode in (True, False):
            if not mode and (check.quick or check.budget.left() < 150):
                out["off"] = dict(status="skipped: time budget kept for the timed sections")
                continue
            start = time.perf_counter()
            result = experiment(make_core, batch_invariant=mode, **sizes)
            out["on" if mode else "off"] = dict(
                runs=result["runs"], differing_tokens=result["differing_tokens"],
                differing_tokens_or_logprobs=result["differing_tokens_or_logprobs"],
                seconds=round(time.perf_counter() - start, 1))
    on = out["on"]
    return dict(status="ok" if on["differing_tokens_or_logprobs"] == 0 else "fail",
                shape=shape, dtype=dtype, sizes=sizes, modes=out,
                summary=f"batch-invariant on: {on['differing_tokens_or_logprobs']} of "
                        f"{on['runs']} runs differ from solo (tokens or logprobs)" + (
                            f"; off: {out['off']['differing_tokens_or_logprobs']} differ"
                            if "runs" in out.get("off", {}) else ""))


# ---------------------------------------------------------------------------- (e) syncs
def prefill_all(core, prompts: list[list[int]], params, prefix: str = "s") -> list[str]:
    """Add the prompts and step until each has its first token: then every step decodes."""
    from duplex.engine.messages import AddRequest

    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts):
        core.add_request(AddRequest(req_id, prompt, params))
    waiting = set(ids)
    while waiting:
        for delta in core.step():
            if delta.new_token_ids:
                waiting.discard(delta.req_id)
    return ids


def repo_frame(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame in this repository (else the innermost), as path:line."""
    for frame in reversed(stack):
        path = Path(frame.filename)
        if ROOT in path.parents and path.name != "gpu_check.py":
            return f"{path.relative_to(ROOT)}:{frame.lineno} ({frame.name})"
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} ({frame.name})"


def sync_debug(check: Check) -> dict:
    """Decode steps under set_sync_debug_mode("warn"), every synchronizing op counted by
    the repository line that issued it; then one step under "error", which raises at the
    first one. The step's one wait is for its draws' copy to pinned memory (an event,
    engine/platform.py HostCopy), read after the next step was queued when overlap is on
    (the engine's default on CUDA; `overlap` in the result)."""
    from duplex.engine.sampling_params import SamplingParams

    path = write_shape_dir(check.tmp, "smollm2-135m")
    num_steps = 8
    params = SamplingParams(temperature=0, max_tokens=num_steps + 8, ignore_eos=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(SHAPES["smollm2-135m"]["vocab_size"]) for _ in range(64)]
               for _ in range(4)]
    sites: dict[str, int] = {}

    def hook(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            site = repo_frame(traceback.extract_stack()[:-1])
            sites[site] = sites.get(site, 0) + 1

    with random_weights(check.device, torch.bfloat16):
        core = make_engine(str(path), check.platform, weights_dtype="bfloat16")
    prefill_all(core, prompts, params)
    for _ in range(2):
        core.step()  # warm: compiled kernels, allocator
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(num_steps):
                core.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    error_site = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        core.step()
    except RuntimeError as error:
        error_site = dict(message=str(error).splitlines()[0],
                          site=repo_frame(traceback.extract_tb(error.__traceback__)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    per_step = sum(sites.values()) / num_steps
    return dict(num_steps=num_steps, batch=len(prompts), syncs_per_step=per_step,
                overlap=core.overlap,
                sites=dict(sorted(sites.items(), key=lambda kv: -kv[1])),
                error_mode=error_site or "no error: the step did not synchronize",
                summary=f"{per_step:g} syncs per decode step at {len(sites)} site(s)"
                        + (f"; error mode stops at {error_site['site']}" if error_site else ""))


# ---------------------------------------------------------------------------- (f) decode
def decode_cells(check: Check) -> list[tuple[str, int, int]]:
    if check.quick:
        return [("tiny", b, c) for b in (1, 4) for c in (16, 64)]
    return [(shape, b, c) for shape in ("smollm2-135m", "llama-8b") for b in (1, 64)
            for c in (128, 2048)]


def decode(check: Check) -> dict:
    """ms per decode step (host clock around core.step, overlapped scheduling on: a step
    returns once the previous step's ids reached the host and this one is queued) at each
    batch and context, beside its bytes / bandwidth floor; for the host-bound small shapes
    also without overlap (`sync_ms_per_step`)."""
    warmup, steps = (1, 2) if check.quick else (5, 20)
    cells, rows = decode_cells(check), []
    dtype = engine_dtype(check)
    dtype_t = getattr(torch, dtype)
    for shape in dict.fromkeys(s for s, _, _ in cells):
        if check.budget.left() < 30:
            rows.append(dict(shape=shape, status="skipped: time budget spent"))
            continue
        mine = [(b, c) for s, b, c in cells if s == shape]
        max_batch, max_ctx = max(b for b, _ in mine), max(c for _, c in mine)
        block = 16
        num_blocks = max_batch * math.ceil((max_ctx + warmup + steps + 2) / block) + 16
        path = write_shape_dir(check.tmp, shape)
        try:
            with random_weights(check.device, dtype_t) as info:
                core = make_engine(str(path), check.platform, weights_dtype=dtype,
                                   overlap="on",  # also on the CPU of --quick: both timings
                                   num_kv_blocks=num_blocks, max_num_seqs=max_batch,
                                   max_num_batched_tokens=256 if check.quick else 8192,
                                   enable_prefix_caching=False, block_size=block)
        except Exception as error:
            rows.append(dict(shape=shape, status=f"error: {type(error).__name__}: "
                                                 f"{str(error)[:200]}"))
            continue
        for batch, ctx in mine:
            cell = dict(shape=shape, batch=batch, context=ctx)
            if check.budget.left() < 15:
                rows.append(dict(cell, status="skipped: time budget spent"))
                continue
            try:
                rows.append(dict(cell, **time_decode(core, batch, ctx, warmup, steps,
                                                     info["weight_bytes"], check, dtype_t)))
                if shape != "llama-8b" and check.budget.left() > 20:  # host-bound shapes
                    rows[-1].update(time_without_overlap(core, batch, ctx, warmup, steps,
                                                         info["weight_bytes"], check, dtype_t))
            except Exception as error:  # e.g. out of memory: the next cells still run
                rows.append(dict(cell, status=f"error: {type(error).__name__}: "
                                              f"{str(error)[:200]}"))
        if check.is_cuda and check.budget.left() > 30:
            graph_cells(core, check, [r for r in rows[-len(mine):] if "ms_per_step" in r],
                        max_batch, warmup, steps, info["weight_bytes"], dtype_t)
        del core
        if check.is_cuda:
            torch.cuda.empty_cache()
    timed = [r for r in rows if "ms_per_step" in r]
    failed = [r for r in rows if r.get("status", "").startswith("error")]
    return dict(status="fail" if failed else "ok", rows=rows, dtype=dtype, warmup_steps=warmup, timed_steps=steps,
                bandwidth_gbs=check.bandwidth_gbs,
                summary=f"{len(timed)}/{len(cells)} cells timed" + (
                    "; ms/step (floor): " + ", ".join(
                        f"{r['shape']} b{r['batch']} c{r['context']} {r['ms_per_step']:.2f}"
                        f" ({r['floor_ms']:.2f})" if r.get("floor_ms") else
                        f"{r['shape']} b{r['batch']} c{r['context']} {r['ms_per_step']:.2f}"
                        for r in timed) if timed else ""))


def graph_cells(core, check: Check, rows: list[dict], max_batch: int, warmup: int,
                steps: int, weight_bytes: int, dtype: torch.dtype) -> None:
    """The same cells again with the decode steps replayed from CUDA graphs
    (engine/cuda_graphs.py): `graph_ms_per_step` in each row, or `graph_status` with why not."""
    from duplex.engine.cuda_graphs import DecodeGraphs

    try:
        t0 = time.perf_counter()
        core.runner.graphs = DecodeGraphs(core.model, core.runner.kv_caches, core.block_size,
                                          core.max_model_len, check.platform, max_batch)
        capture_s = time.perf_counter() - t0
    except Exception as error:
        for row in rows:
            row["graph_status"] = f"capture failed: {type(error).__name__}: {str(error)[:160]}"
        return
    for row in rows:
        if check.budget.left() < 15:
            row["graph_status"] = "skipped: time budget spent"
            continue
        try:
            before = core.runner.graphs.replays
            timed = time_decode(core, row["batch"], row["context"], warmup, steps, weight_bytes,
                                check, dtype)
            row.update(graph_ms_per_step=timed["ms_per_step"], graph_capture_s=round(capture_s, 2),
                       graph_replays=core.runner.graphs.replays - before)
        except Exception as error:
            row["graph_status"] = f"error: {type(error).__name__}: {str(error)[:160]}"
    core.runner.graphs = None


def time_without_overlap(core, *cell) -> dict:
    """The cell again with overlapped scheduling off (engine/core.py): the step then waits
    for its tokens before the host schedules the next. `overlap` says what ms_per_step ran
    with; `sync_ms_per_step` is the other timing when overlap was on."""
    if not core.overlap:
        return dict(overlap=False)
    core.overlap = False
    try:
        return dict(overlap=True, sync_ms_per_step=time_decode(core, *cell)["ms_per_step"])
    finally:
        core.overlap = True


def time_decode(core, batch: int, ctx: int, warmup: int, steps: int, weight_bytes: int,
                check: Check, dtype: torch.dtype) -> dict:
    from duplex.engine.sampling_params import SamplingParams

    args = core.args
    rng = random.Random(batch * 100003 + ctx)
    prompts = [[rng.randrange(args.vocab_size) for _ in range(ctx)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=warmup + steps + 2, ignore_eos=True)
    t0 = time.perf_counter()
    ids = prefill_all(core, prompts, params, prefix=f"d{batch}-{ctx}-")
    prefill_s = time.perf_counter() - t0
    for _ in range(warmup):
        core.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - t0) * 1e3)
    core.abort_requests(ids)
    while core.has_unfinished_requests():
        core.step()
    mid_ctx = ctx + warmup + steps // 2
    kv_bytes = batch * mid_ctx * args.num_layers * 2 * args.num_kv_heads * args.head_dim * \
        dtype.itemsize
    floor = None if not check.bandwidth_gbs else \
        (weight_bytes + kv_bytes) / (check.bandwidth_gbs * 1e9) * 1e3
    ms = statistics.median(times)
    return dict(ms_per_step=ms, min_ms=min(times), floor_ms=floor,
                over_floor=None if floor is None else ms / floor, weight_bytes=weight_bytes,
                kv_bytes=kv_bytes, prefill_s=round(prefill_s, 2))


# ---------------------------------------------------------------------------- (g) kernels
KERNEL_SHAPES = {  # (query heads, kv heads, head_dim)
    "smollm2-135m": (9, 3, 64),
    "llama-8b": (32, 8, 128),
}


def paged_and_contiguous(batch: int, ctx: int, heads: tuple[int, int, int],
                         device: torch.device, dtype: torch.dtype, block_size: int = 16,
                         num_queries: int = 1):
    """One draw of random q and KV: the paged layout the triton kernels read (blocks in
    random order) and the contiguous one SDPA reads, holding the same values."""
    num_heads, num_kv_heads, head_dim = heads
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    # k, v: [batch, kv_heads, ctx, head_dim] contiguous
    k, v = (torch.randn(batch, num_kv_heads, ctx, head_dim, device=device, dtype=dtype)
            for _ in range(2))
    table = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)
    caches = []
    for t in (k, v):
        cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=device,
                            dtype=dtype)
        padded = torch.zeros(batch, blocks_per_seq * block_size, num_kv_heads, head_dim,
                             device=device, dtype=dtype)
        padded[:, :ctx] = t.transpose(1, 2)
        cache[table.flatten()] = padded.view(num_blocks, block_size, num_kv_heads, head_dim)
        caches.append(cache)
    q = torch.randn(batch * num_queries, num_heads, head_dim, device=device, dtype=dtype)
    query_start_loc = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * num_queries
    seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    paged = (q, caches[0], caches[1], table.int().contiguous(), query_start_loc, seq_lens)
    return paged, (k, v)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, causal: bool,
         backend: str | None) -> torch.Tensor:
    """torch SDPA on contiguous KV; q `[batch * num_queries, heads, dim]` -> same shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    num_heads, head_dim = q.shape[1], q.shape[2]
    q4 = q.view(batch, -1, num_heads, head_dim).transpose(1, 2)  # [b, h, nq, d]
    ctx = contextlib.nullcontext() if backend is None else \
        sdpa_kernel(getattr(SDPBackend, backend))
    with ctx:
        out = torch.nn.functional.scaled_dot_product_attention(
            q4, k, v, is_causal=causal, enable_gqa=k.shape[1] != num_heads)
    return out.transpose(1, 2).reshape(q.shape)


def sdpa_variant(q, k, v, batch: int, causal: bool) -> tuple[Callable[[], torch.Tensor], str]:
    """The first SDPA that runs: flash with grouped KV heads, flash on KV heads repeated to
    the query heads (4x the KV bytes for Llama-8B's groups), else torch's own pick."""
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))
    tries = [(lambda: sdpa(q, k, v, batch, causal, "FLASH_ATTENTION"), "flash"),
             (lambda: sdpa(q, k_rep, v_rep, batch, causal, "FLASH_ATTENTION"),
              "flash, kv repeated"),
             (lambda: sdpa(q, k, v, batch, causal, None), "default")]
    for fn, label in tries:
        try:
            fn()
            return fn, label
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran these inputs")


def kernel_case(shape: str, batch: int, ctx: int, device: torch.device, dtype: torch.dtype,
                bandwidth_gbs: float | None, num_queries: int = 1, iters: int = 20,
                tflops: float | None = None) -> dict:
    """Triton paged attention (split-KV for decode, kernels.attention for prefill) against
    SDPA (flash where it runs, else torch's pick) and FlashInfer (decode, where installed)."""
    from duplex.kernels.attention import paged_attention_triton
    from duplex.kernels.decode_attention import decode_attention_triton

    heads = KERNEL_SHAPES[shape]
    paged, (k, v) = paged_and_contiguous(batch, ctx, heads, device, dtype,
                                         num_queries=num_queries)
    scale = heads[2] ** -0.5
    if num_queries == 1:
        triton_fn = lambda: decode_attention_triton(*paged, scale, max_seq_len=ctx)  # noqa: E731
    else:
        triton_fn = lambda: paged_attention_triton(*paged, scale,  # noqa: E731
                                                   max_query_len=num_queries)
    causal = num_queries > 1
    sdpa_fn, label = sdpa_variant(paged[0], k, v, batch, causal)
    ref, got = sdpa_fn(), triton_fn()
    row = dict(shape=shape, batch=batch, context=ctx, queries=num_queries,
               max_abs_diff=float((got.float() - ref.float()).abs().max()),
               sdpa_backend=label, triton_ms=time_ms(triton_fn, device, iters),
               sdpa_ms=time_ms(sdpa_fn, device, iters))
    # floor: KV bytes read at the copy bandwidth; for a causal prefill also half the
    # full QK^T and PV FLOPs at the measured bf16 matmul rate, whichever is longer
    kv_bytes = 2 * k.numel() * k.element_size()
    floors = [] if not bandwidth_gbs else [kv_bytes / (bandwidth_gbs * 1e9) * 1e3]
    if num_queries > 1 and tflops:
        flops = 4 * batch * heads[0] * num_queries * ctx * heads[2] / 2
        floors.append(flops / (tflops * 1e12) * 1e3)
    row["floor_ms"] = max(floors) if floors else None
    if num_queries == 1:
        row.update(flashinfer_decode(paged, ctx, heads, scale, device, iters))
    return row


MLA_SHAPE = (512, 64, 128)  # DeepSeek-V3: kv_lora_rank, rope dims, query heads


def mla_case(batch: int, ctx: int, device: torch.device, dtype: torch.dtype,
             bandwidth_gbs: float | None, iters: int = 20, dims=MLA_SHAPE,
             block_size: int = 64) -> dict:
    """duplex.kernels.mla_decode's split-KV kernel on DeepSeek-V3's latent cache against its torch
    reference (the CPU path: gather, two bmm), random latents, every sequence `ctx` long;
    floor: the latent bytes read at the copy bandwidth."""
    from duplex.kernels.mla_decode import mla_attend_ref, mla_decode_triton

    rank, rope, heads = dims
    half = (rank + rope) // 2
    blocks = -(-ctx // block_size)
    gen = torch.Generator(device=device).manual_seed(0)
    planes = torch.randn(2, batch * blocks, block_size, 1, half, generator=gen, device=device,
                         dtype=torch.float32).to(dtype)
    table = torch.randperm(batch * blocks, generator=gen, device=device).view(batch, blocks)
    table = table.to(torch.int32)
    q = torch.randn(batch, heads, rank + rope, generator=gen, device=device,
                    dtype=torch.float32).to(dtype)
    starts = torch.arange(batch + 1, device=device, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    scale = (rank + rope) ** -0.5
    triton_fn = lambda: mla_decode_triton(  # noqa: E731
        q, planes[0], planes[1], table, starts, lens, scale, rank, max_seq_len=ctx)
    torch_fn = lambda: mla_attend_ref(q[:, None], planes[0], planes[1], table,  # noqa: E731
                                      lens.long(), scale, rank, ctx)[:, 0]
    diff = float((triton_fn().float() - torch_fn().float()).abs().max())
    latent_bytes = batch * ctx * (rank + rope) * planes.element_size()
    return dict(shape="deepseek-v3 mla", batch=batch, context=ctx, queries=1,
                max_abs_diff=diff, triton_ms=time_ms(triton_fn, device, iters),
                torch_ms=time_ms(torch_fn, device, iters),
                floor_ms=latent_bytes / (bandwidth_gbs * 1e9) * 1e3 if bandwidth_gbs else None)


def flashinfer_decode(paged, ctx: int, heads, scale: float, device: torch.device,
                      iters: int) -> dict:
    try:
        import flashinfer
    except ImportError:
        return dict(flashinfer="not installed")
    try:
        q, k_cache, v_cache, table, _, _ = paged
        batch, blocks_per_seq = table.shape
        block_size = k_cache.shape[1]
        workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        indptr = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * blocks_per_seq
        last = torch.full((batch,), ctx - (blocks_per_seq - 1) * block_size, device=device,
                          dtype=torch.int32)
        wrapper.plan(indptr, table.flatten().int(), last, heads[0], heads[1], heads[2],
                     block_size, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
                     sm_scale=scale)
        fn = lambda: wrapper.run(q, (k_cache, v_cache))  # noqa: E731
        return dict(flashinfer=getattr(flashinfer, "__version__", "?"),
                    flashinfer_ms=time_ms(fn, device, iters))
    except Exception as error:  # an API it lacks or shapes it refuses: say which
        return dict(flashinfer=f"error: {type(error).__name__}: {str(error)[:160]}")


def kernel_bench(check: Check) -> dict:
    rows = []
    cases = [(s, b, c, 1) for s in KERNEL_SHAPES for b in (1, 64) for c in (128, 2048)]
    cases.append(("llama-8b", 4, 2048, 2048))  # prefill: 4 sequences of 2,048 queries
    for shape, batch, ctx, nq in cases:
        if check.budget.left() < 5:
            rows.append(dict(shape=shape, batch=batch, context=ctx, queries=nq,
                             status="skipped: time budget spent"))
            continue
        try:
            rows.append(kernel_case(shape, batch, ctx, check.device, torch.bfloat16,
                                    check.bandwidth_gbs, num_queries=nq,
                                    tflops=check.bf16_tflops))
        except Exception as error:
            rows.append(dict(shape=shape, batch=batch, context=ctx, queries=nq,
                             status=f"error: {type(error).__name__}: {str(error)[:200]}"))
    for batch in (1, 64):  # MLA decode (DeepSeek-V3's latent), against its torch path
        cases.append(("deepseek-v3 mla", batch, 2048, 1))
        if check.budget.left() < 5:
            rows.append(dict(shape="deepseek-v3 mla", batch=batch, context=2048, queries=1,
                             status="skipped: time budget spent"))
            continue
        try:
            rows.append(mla_case(batch, 2048, check.device, torch.bfloat16,
                                 check.bandwidth_gbs))
        except Exception as error:
            rows.append(dict(shape="deepseek-v3 mla", batch=batch, context=2048, queries=1,
                             status=f"error: {type(error).__name__}: {str(error)[:200]}"))
    bad = [r for r in rows if r.get("max_abs_diff", 0) > 0.05 or "error" in r.get("status", "")]
    return dict(status="fail" if bad else "ok", rows=rows,
                summary=f"{sum('triton_ms' in r for r in rows)}/{len(cases)} cases timed, "
                        f"{len(bad)} wrong or failed (|triton - sdpa| > 0.05 in bf16)")


# ---------------------------------------------------------------------------- report
def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [f"# GPU check ({m.get('gpu', m['device'])}, {m['date']})", "",
             f"torch {m['torch']}, transformers {m['transformers']}, triton "
             f"{m.get('triton', '-')}, python {m['python']}; {m['elapsed_s']} s of a "
             f"{m['budget_s']:.0f} s budget{', --quick' if m['quick'] else ''}", "",
             "| section | status | seconds | summary |", "|---|---|---|---|"]
    for name, r in report["sections"].items():
        summary = r.get("summary") or r.get("error") or ""
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.1f} | "
                     f"{str(summary).replace('|', '/')} |")
    greedy_r = report["sections"]["greedy"].get("models")
    if greedy_r:
        lines += ["", "| model | fp32 equal | fp32 max Δlogprob | bf16 token agreement "
                  "(transformers bf16) | bf16 max Δlogprob (transformers bf16) |",
                  "|---|---|---|---|---|"]
        for name, r in greedy_r.items():
            f, b, h = r.get("float32", {}), r.get("bfloat16", {}), r.get("hf_bfloat16", {})
            lines.append(f"| {name} | {f.get('equal', r.get('status', '-'))} | "
                         f"{_num(f.get('max_logprob_diff'))} | "
                         f"{_num(b.get('token_agreement'))} ({_num(h.get('token_agreement'))}) | "
                         f"{_num(b.get('max_logprob_diff'))} ({_num(h.get('max_logprob_diff'))}) |")
    rows = report["sections"]["decode"].get("rows")
    if rows:
        lines += ["", "| shape | batch | context | ms/step | without overlap ms/step "
                  "| CUDA graphs ms/step | floor ms | × floor | prefill s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['shape']} | {r.get('batch', '-')} | {r.get('context', '-')} | "
                         f"{_num(r.get('ms_per_step'), r.get('status', '-'))} | "
                         f"{_num(r.get('sync_ms_per_step'))} | "
                         f"{_num(r.get('graph_ms_per_step'), r.get('graph_status', '-'))} | "
                         f"{_num(r.get('floor_ms'))} | {_num(r.get('over_floor'))} | "
                         f"{_num(r.get('prefill_s'))} |")
    rows = report["sections"]["kernels"].get("rows")
    if rows:
        lines += ["", "| shape | batch | context | queries | triton ms | sdpa (MLA: torch) ms "
                  "| flashinfer ms "
                  "| floor ms | max abs diff |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['queries']} | "
                         f"{_num(r.get('triton_ms'), r.get('status', '-'))} | "
                         f"{_num(r.get('sdpa_ms', r.get('torch_ms')))} | "
                         f"{_num(r.get('flashinfer_ms'), r.get('flashinfer', '-'))} | "
                         f"{_num(r.get('floor_ms'))} | {_num(r.get('max_abs_diff'))} |")
    sites = report["sections"]["sync_debug"].get("sites")
    if sites:
        lines += ["", "| sync site | count |", "|---|---|"]
        lines += [f"| {site} | {n} |" for site, n in sites.items()]
    return "\n".join(lines) + "\n"


def _num(x, default: str = "-") -> str:
    if x is None:
        return str(default)
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def write_report(out: Path, report: dict) -> str:
    """gpu_check.json and gpu_check.md under out (each written whole, then renamed)."""
    text = markdown(report)
    for name, content in (("gpu_check.json", json.dumps(report, indent=2, default=str)),
                          ("gpu_check.md", text)):
        tmp = out / f".{name}.tmp"
        tmp.write_text(content)
        tmp.replace(out / name)
    return text


# ---------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes and few steps: the CPU smoke run the tests use")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="total seconds; sections past it are skipped with a note")
    parser.add_argument("--pytest-timeout-s", type=float, default=150.0,
                        help="the most seconds `pytest -m gpu` may take")
    parser.add_argument("--only", default="",
                        help=f"comma-separated sections to run (of {', '.join(SECTIONS)})")
    parser.add_argument("--out", default=os.environ.get("OUT") or "out/gpu_check",
                        help="folder for gpu_check.json and gpu_check.md (default $OUT)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run_all(args, on_section=lambda partial: write_report(out, partial))
    print(write_report(out, report))
    failed = [n for n, r in report["sections"].items() if r["status"] in ("error", "fail")
              or r["status"].startswith("fail")]
    return 1 if failed else 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m duplex.bench.gpu_check")
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
