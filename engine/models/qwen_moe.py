"""Qwen3-MoE and Qwen2-MoE: Qwen decoders with sparse MoE blocks.

Qwen3-MoE: Qwen3 attention (RMSNorm on each q and k head), softmax top-k router with
optional renormalisation (norm_topk_prob), no shared expert. Qwen2-MoE: Qwen2 attention
(q/k/v bias) plus a shared expert on every token, scaled by sigmoid(x @ shared_expert_gate).
Both keep dense MLPs on `mlp_only_layers` and off the `decoder_sparse_step` grid.
"""
from __future__ import annotations

from duplex.engine.models.moe import MoEDecoderLayer, MoEForCausalLM
from duplex.engine.models.qwen import Qwen3Attention


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen2MoeForCausalLM(MoEForCausalLM):
    pass  # bias on q/k/v comes from ModelArgs.attention_bias, the shared expert from MoEArgs
