"""Model registry: architecture name -> model class (one file per family)."""
from __future__ import annotations

from engine.models.llama import ForwardContext, LlamaForCausalLM
from engine.models.loader import ModelArgs, ModelLoadError, load
from engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def build_model(args: ModelArgs, state):
    try:
        cls = MODEL_CLASSES[args.arch]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {args.arch!r}") from None
    return cls(args, state)


__all__ = ["ForwardContext", "ModelArgs", "ModelLoadError", "build_model", "load"]
