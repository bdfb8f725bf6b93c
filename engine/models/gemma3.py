"""Gemma 3 text decoder (Gemma3ForCausalLM, model_type gemma3_text) on the Llama code.

What differs from Llama, each as transformers computes it:
* the token embedding is multiplied by sqrt(hidden), rounded to the weights' dtype first;
* every RMSNorm scales by (1 + weight), in fp32 (`ops.rms_norm(..., offset=1.0)`), and each
  layer normalises four times: before and after attention, before and after the MLP;
* q and k are normalised per head (as Qwen3, with the Gemma norm) before rotary;
* attention scores are scaled by query_pre_attn_scalar ** -0.5; the output logits are
  soft-capped (`cap * tanh(logits / cap)`) when final_logit_softcapping is set. The config's
  attn_logit_softcapping is NOT applied: transformers' Gemma3Attention ignores it;
* the MLP gate is GELU with the tanh approximation;
* sliding layers rotate with their own base (rope_local_base_freq, no scaling), full layers
  with rope_theta and its scaling ("linear" divides the frequencies by the factor).
Which layers slide comes from the config's layer_types (see engine.models.loader).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from duplex.engine.models.llama import MLP, Attention, ForwardContext, LlamaForCausalLM
from duplex.engine.models.args import ModelArgs
from duplex.kernels import ops
from duplex.kernels.rotary import rope_cos_sin_cache

GEMMA_NORM_OFFSET = 1.0  # out = norm(x) * (1 + weight)


class Gemma3Attention(Attention):
    joint_rope = False  # q and k are normalised per head before rotary

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], prefix: str,
                 layer: int) -> None:
        super().__init__(args, state, prefix, layer)
        self.scale = args.query_pre_attn_scalar ** -0.5
        self.eps = args.rms_norm_eps
        self.q_norm = state.pop(f"{prefix}.q_norm.weight")  # [head_dim]
        self.k_norm = state.pop(f"{prefix}.k_norm.weight")

    def project_qkv(self, x: torch.Tensor):
        q, k, v = super().project_qkv(x)
        return (ops.rms_norm(q, self.q_norm, self.eps, offset=GEMMA_NORM_OFFSET),
                ops.rms_norm(k, self.k_norm, self.eps, offset=GEMMA_NORM_OFFSET), v)


class Gemma3MLP(MLP):
    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class Gemma3DecoderLayer:
    """The stream entering the layer is h + residual (residual is None before layer 0);
    each residual add is fused into the norm that follows it."""

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], prefix: str,
                 layer: int) -> None:
        self.eps = args.rms_norm_eps
        self.input_norm = state.pop(f"{prefix}.input_layernorm.weight")
        self.post_attn_norm = state.pop(f"{prefix}.post_attention_layernorm.weight")
        self.pre_mlp_norm = state.pop(f"{prefix}.pre_feedforward_layernorm.weight")
        self.post_mlp_norm = state.pop(f"{prefix}.post_feedforward_layernorm.weight")
        self.attn = Gemma3Attention(args, state, f"{prefix}.self_attn", layer)
        self.mlp = Gemma3MLP(state, f"{prefix}.mlp")

    def norm(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, weight, self.eps, residual, offset=GEMMA_NORM_OFFSET)

    def forward(self, h, residual, ctx: ForwardContext, layer: int, cos_sin):
        if residual is None:
            x, residual = self.norm(h, self.input_norm), h
        else:
            x, residual = self.norm(h, self.input_norm, residual)
        x = self.norm(self.attn.forward(x, ctx, layer, cos_sin), self.post_attn_norm)
        x, residual = self.norm(x, self.pre_mlp_norm, residual)
        return self.norm(self.mlp.forward(x), self.post_mlp_norm), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor]) -> None:
        super().__init__(args, state)  # self.cos_sin: the full layers' rope
        self.local_cos_sin = rope_cos_sin_cache(args.head_dim, args.max_position_embeddings,
                                                args.rope_local_theta)
        # transformers rounds the fp32 scale to the weights' dtype (bf16: sqrt(3072) -> 55.5)
        self.embed_scale = torch.tensor(args.hidden_size ** 0.5).to(self.embed.dtype)

    @staticmethod
    def rope_cache(args: ModelArgs) -> torch.Tensor:
        dim = args.head_dim
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float()
                                              / dim))
        if args.rope_scaling is not None:  # "linear", the only type the loader accepts
            inv_freq = inv_freq / args.rope_scaling["factor"]
        return rope_cos_sin_cache(dim, args.max_position_embeddings, inv_freq=inv_freq)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden]."""
        h = ops.embedding(input_ids, self.embed) * self.embed_scale  # [T, hidden]
        residual = None
        for i, (layer, window) in enumerate(zip(self.layers, self.layer_windows)):
            cos_sin = self.cos_sin if window is None else self.local_cos_sin
            h, residual = layer.forward(h, residual, ctx, i, cos_sin)
        h, _ = ops.rms_norm(h, self.norm, self.args.rms_norm_eps, residual,
                            offset=GEMMA_NORM_OFFSET)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab], soft-capped when the config says."""
        logits = ops.linear(hidden, self.lm_head)  # [N, vocab]
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
