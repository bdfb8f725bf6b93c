"""Model registry: architecture name -> model class (one file per family).

Lazy (PEP 562): the frontend reads a GGUF file's header through `engine.models.gguf_file`
without loading torch, which only the model classes and the loader need; a process that
imports this package for that alone (`duplex serve` checks the file before it starts a
worker) stays ~0.3 GB smaller."""
from __future__ import annotations

import importlib

# architecture -> (module, class)
MODEL_CLASSES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen", "Qwen2ForCausalLM"),
    "qwen3": ("qwen", "Qwen3ForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "deepseek_v2": ("deepseek_v3", "DeepseekV3ForCausalLM"),  # softmax routing (MoEArgs.scoring)
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
}
_EXPORTS = {"ForwardContext": "llama", "ModelArgs": "args", "ModelLoadError": "args",
            "load": "loader"}


def model_class(arch: str):
    """The model class of an architecture; ModelLoadError for one Duplex has no class for."""
    from duplex.engine.models.args import ModelLoadError

    try:
        module, name = MODEL_CLASSES[arch]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {arch!r}") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def build_model(args, state):
    return model_class(args.arch)(args, state)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ForwardContext", "ModelArgs", "ModelLoadError", "build_model", "load",
           "model_class"]
