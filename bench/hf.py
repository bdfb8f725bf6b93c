"""Loading a tokenizer or a plain transformers model from a local GGUF file or HF directory.

Nothing is fetched from a hub: paths must exist. The model here is the reference a user without
a serving engine would run (fp32 weights, `generate`); Duplex's own loader lives in `engine/`.
"""
from __future__ import annotations

import functools
import importlib.util
import os


def default_model_path() -> str:
    from duplex.engine.config import default_model_path as engine_default
    return engine_default()


def _split(path: str) -> tuple[str, dict]:
    """(directory, extra from_pretrained kwargs) for a GGUF file or a model directory."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path!r} (nothing is fetched "
                                "from a hub; give a local GGUF file or Hugging Face directory)")
    if path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
    return path, {}


def load_tokenizer(path: str | None = None):
    """The tokenizer of a GGUF file or HF directory (default: the default model's), loaded
    once per path however it is spelled (`load_tokenizer()` and `load_tokenizer(None)` were
    two cache keys, and a GGUF tokenizer takes seconds to build)."""
    return _load_tokenizer(os.path.abspath(path or default_model_path()))


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str):
    from transformers import AutoTokenizer
    directory, kwargs = _split(path)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)


def load_model(path: str | None = None):
    """An fp32 `AutoModelForCausalLM` in eval mode.

    transformers wants `accelerate` to read GGUF through `from_pretrained`; without it the
    model is built from its config and the GGUF tensors are dequantized into it directly.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    directory, kwargs = _split(path or default_model_path())
    if not kwargs or importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, dtype=torch.float32, **kwargs)
    else:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        config = AutoConfig.from_pretrained(directory, local_files_only=True, **kwargs)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        gguf_path = os.path.join(directory, kwargs["gguf_file"])
        tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)
        result = model.load_state_dict(tensors["tensors"], strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(result.missing_keys) - tied:
            raise ValueError(f"{gguf_path}: no weights for {sorted(result.missing_keys)}")
        model.tie_weights()
    return model.eval()
