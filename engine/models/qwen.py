"""Qwen2 and Qwen3: Llama-shaped decoders that differ only in the q/k/v projection.

Qwen2 adds a bias to q, k and v (ModelArgs.attention_bias, handled by the Llama code).
Qwen3 has no bias but normalises each head of q and k with RMSNorm before rotary.
Both may window the layers from max_window_layers on (use_sliding_window; see the loader).
"""
from __future__ import annotations

import torch

from duplex.engine.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from duplex.engine.models.args import ModelArgs
from duplex.kernels import ops


class Qwen3Attention(Attention):
    joint_rope = False  # q and k are normalised per head before rotary

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], prefix: str,
                 layer: int) -> None:
        super().__init__(args, state, prefix, layer)
        self.eps = args.rms_norm_eps
        self.q_norm = state.pop(f"{prefix}.q_norm.weight")  # [head_dim]
        self.k_norm = state.pop(f"{prefix}.k_norm.weight")

    def project_qkv(self, x: torch.Tensor):
        q, k, v = super().project_qkv(x)
        return ops.rms_norm(q, self.q_norm, self.eps), ops.rms_norm(k, self.k_norm, self.eps), v


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
