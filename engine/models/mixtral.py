"""Mixtral: a Llama/Mistral decoder whose MLP is a sparse MoE block.

Each token goes to the top-2 of `num_local_experts` SwiGLU experts by softmax router weight,
the two weights renormalised to sum to 1. Checkpoint names: `block_sparse_moe.gate` (router)
and `block_sparse_moe.experts.{e}.w1 / w3 / w2` (gate / up / down).
"""
from __future__ import annotations

from duplex.engine.models.moe import MoEDecoderLayer, MoEForCausalLM


class MixtralDecoderLayer(MoEDecoderLayer):
    block_name = "block_sparse_moe"


class MixtralForCausalLM(MoEForCausalLM):
    layer_cls = MixtralDecoderLayer
    expert_prefix = "block_sparse_moe.experts"
    expert_names = ("w1", "w3", "w2")
