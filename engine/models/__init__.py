"""Model registry: architecture name -> model class (one file per family)."""
from __future__ import annotations

from duplex.engine.models.gemma3 import Gemma3ForCausalLM
from duplex.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from duplex.engine.models.llama import ForwardContext, LlamaForCausalLM
from duplex.engine.models.args import ModelArgs, ModelLoadError
from duplex.engine.models.loader import load
from duplex.engine.models.mixtral import MixtralForCausalLM
from duplex.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from duplex.engine.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v2": DeepseekV3ForCausalLM,  # softmax routing (MoEArgs.scoring)
    "deepseek_v3": DeepseekV3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}


def build_model(args: ModelArgs, state):
    try:
        cls = MODEL_CLASSES[args.arch]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {args.arch!r}") from None
    return cls(args, state)


__all__ = ["ForwardContext", "ModelArgs", "ModelLoadError", "build_model", "load"]
