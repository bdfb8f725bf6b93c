"""DeepSeek-V3: multi-head latent attention (MLA) and a MoE with grouped, bias-corrected routing.

MLA compresses each token's keys and values into one latent `c_kv [kv_lora_rank]` (RMS-normed)
plus one rope key `k_pe [qk_rope_head_dim]` shared by all heads; per head,
`k_nope = W_UK c_kv` and `v = W_UV c_kv`. Attention runs in the latent space ("absorbed"):
`q_lat = W_UK^T q_nope`, scores `q_lat . c_kv + q_pe . k_pe`, output `W_UV (probs @ c_kv)`,
so the cache holds only the latent, never per-head keys or values.

Cache layout: the latent `[c_kv | k_pe]` (`D = kv_lora_rank + qk_rope_head_dim`, 576 for the
real model) is stored as one kv head of width D / 2 split over the runner's two planes:

    k plane  kv[layer, 0, block, slot, 0, :]  = latent[:D/2]
    v plane  kv[layer, 1, block, slot, 0, :]  = latent[D/2:]

so ModelArgs says num_kv_heads = 1, head_dim = D / 2 and the runner's one-tensor pool, the
block-byte accounting and the host/disk tiers work unchanged with no byte wasted; attention
reads both planes (`mla_attention`) instead of treating them as k and v.

Rope: the first `first_k_dense_replace` layers have a dense MLP; the rest a MoE with shared
experts (engine/models/moe.py, `grouped_topk`: V3's sigmoid scores with a correction bias,
or V2 / V2.5's softmax, model_type deepseek_v2 and softmax-gated GGUFs). Rope covers the qk_rope_head_dim dims only;
checkpoints with rope_interleave have those dims in (even, odd) pairs, which the loader
reorders (q_b_proj / kv_a_proj rows) to halves so the standard neox rotary applies and
gives transformers' values bit for bit. YaRN scaling (rope_type "yarn") is supported: its
inv_freq, the cos/sin factor and the softmax scale correction (mscale_all_dim).
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from duplex.engine.models.llama import ForwardContext
from duplex.engine.models.args import ModelArgs
from duplex.engine.models.moe import MoEBlock, MoEDecoderLayer, MoEForCausalLM, grouped_topk
from duplex.kernels import ops
from duplex.kernels.mla_decode import mla_attend_ref, mla_decode_triton
from duplex.kernels.rotary import rope_cos_sin_cache

MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps, not rms_norm_eps


class MLAAttention:
    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], prefix: str,
                 layer: int) -> None:
        mla = args.mla
        self.num_heads = args.num_heads
        self.rank, self.rope_dim = mla.kv_lora_rank, mla.qk_rope_head_dim
        self.nope_dim, self.v_dim = mla.qk_nope_head_dim, mla.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        interleaved = mla.rope_interleave
        pop = state.pop
        if mla.q_lora_rank:
            self.q_a_weight = pop(f"{prefix}.q_a_proj.weight")  # [q_lora_rank, hidden]
            self.q_a_bias = pop(f"{prefix}.q_a_proj.bias", None)
            self.q_a_norm = pop(f"{prefix}.q_a_layernorm.weight")
            q_weight = pop(f"{prefix}.q_b_proj.weight")  # [heads * qk_dim, q_lora_rank]
        else:
            self.q_a_weight = None
            q_weight = pop(f"{prefix}.q_proj.weight")  # [heads * qk_dim, hidden]
        self.q_weight = _rope_rows_to_halves(q_weight, self.num_heads, self.nope_dim, interleaved)
        kv_a = pop(f"{prefix}.kv_a_proj_with_mqa.weight")  # [rank + rope, hidden]
        self.kv_a_weight = _rope_rows_to_halves(kv_a, 1, self.rank, interleaved)
        self.kv_a_bias = pop(f"{prefix}.kv_a_proj_with_mqa.bias", None)
        if self.kv_a_bias is not None:
            self.kv_a_bias = _rope_rows_to_halves(self.kv_a_bias[:, None], 1, self.rank,
                                                  interleaved)[:, 0]
        self.kv_a_norm = pop(f"{prefix}.kv_a_layernorm.weight")
        kv_b = pop(f"{prefix}.kv_b_proj.weight").view(self.num_heads, -1, self.rank)
        self.w_uk = kv_b[:, :self.nope_dim].contiguous()  # [heads, nope, rank]
        self.w_uv_t = kv_b[:, self.nope_dim:].transpose(1, 2).contiguous()  # [heads, rank, v]
        self.o_weight = pop(f"{prefix}.o_proj.weight")  # [hidden, heads * v]
        self.o_bias = pop(f"{prefix}.o_proj.bias", None)
        self.scale = qk_dim ** -0.5
        scaling = args.rope_scaling or {}
        if scaling.get("mscale_all_dim"):
            self.scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_a_weight is not None:
            x = ops.rms_norm(ops.linear(x, self.q_a_weight, self.q_a_bias), self.q_a_norm,
                             MLA_NORM_EPS)
        # [T, heads, nope + rope]
        return ops.linear(x, self.q_weight).view(x.shape[0], self.num_heads, -1)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int,
                cos_sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_nope, q_pe = self.project_q(x).split([self.nope_dim, self.rope_dim], dim=-1)
        kv = ops.linear(x, self.kv_a_weight, self.kv_a_bias)  # [T, rank + rope]
        c_kv = ops.rms_norm(kv[:, :self.rank].contiguous(), self.kv_a_norm, MLA_NORM_EPS)
        q_pe, k_pe = ops.rotary_embedding(ctx.positions, q_pe.contiguous(),
                                          kv[:, None, self.rank:].contiguous(), cos_sin)
        latent = torch.cat([c_kv, k_pe[:, 0]], dim=-1)  # [T, D]
        half = latent.shape[1] // 2
        k_cache, v_cache = ctx.kv_caches[layer]
        ops.store_kv(latent[:, None, :half], latent[:, None, half:], k_cache, v_cache,
                     ctx.slot_mapping)
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [heads, T, rank]
        q = torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1)  # [T, heads, D]
        out = mla_attention(q, k_cache, v_cache, ctx, self.scale, self.rank)  # [T, heads, rank]
        out = torch.bmm(out.transpose(0, 1), self.w_uv_t)  # [heads, T, v]
        out = out.transpose(0, 1).reshape(num_tokens, self.num_heads * self.v_dim)
        return ops.linear(out, self.o_weight, self.o_bias)  # [T, hidden]


def _rope_rows_to_halves(weight: torch.Tensor, heads: int, start: int,
                         interleaved: bool) -> torch.Tensor:
    """Reorder each head's rope rows (from `start` on) from (even, odd) pairs to halves:
    output dim 2i goes to i and 2i+1 to rope/2 + i. Not interleaved: unchanged."""
    if not interleaved:
        return weight
    rows = weight.view(heads, -1, weight.shape[-1])
    rope = rows[:, start:]
    fixed = torch.cat([rows[:, :start], rope[:, 0::2], rope[:, 1::2]], dim=1)
    return fixed.reshape(weight.shape).contiguous()


def mla_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  ctx: ForwardContext, scale: float, rank: int) -> torch.Tensor:
    """Causal varlen attention over the paged latent cache (layout in the module docstring).

    q [T, heads, D] latent-space queries, `kernels.attention` conventions for the batch
    -> [T, heads, rank]: probabilities times c_kv. Decode rows: on the device path the
    split-KV triton kernel (kernels/mla_decode.py), else one padded batch through the torch
    reference; prefill chunks one sequence at a time through the reference. The step's host
    lengths size everything, so nothing is read back from the device."""
    out = q.new_empty(*q.shape[:2], rank)
    if ctx.query_lens is not None:  # the host's numbers: no device sync
        q_lens = ctx.query_lens
        starts = [0, *itertools.accumulate(q_lens)]
    else:
        starts = ctx.query_start_loc.tolist()
        q_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    host_lens = ctx.host_seq_lens
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode and ops.runs_triton(q):  # every decode row in one launch, the others left alone
        mla_decode_triton(q, k_cache, v_cache, ctx.block_tables, ctx.query_start_loc,
                          ctx.seq_lens, scale, rank,
                          max_seq_len=None if host_lens is None else max(host_lens), out=out)
    elif decode:
        seqs = torch.tensor(decode, device=q.device)
        rows = torch.tensor([starts[i] for i in decode], device=q.device)
        max_len = None if host_lens is None else max(host_lens[i] for i in decode)
        out[rows] = mla_attend_ref(q[rows][:, None], k_cache, v_cache, ctx.block_tables[seqs],
                                   ctx.seq_lens[seqs].long(), scale, rank, max_len)[:, 0]
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            rows = slice(starts[i], starts[i] + q_len)
            out[rows] = mla_attend_ref(q[rows][None], k_cache, v_cache,
                                       ctx.block_tables[i:i + 1], ctx.seq_lens[i:i + 1].long(),
                                       scale, rank,
                                       None if host_lens is None else host_lens[i])[0]
    return out


class DeepseekV3MoE(MoEBlock):
    shared_name = "shared_experts"

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], prefix: str,
                 moe_layer: int) -> None:
        super().__init__(args, state, prefix, moe_layer)
        # [num_experts]; DeepSeek V2 checkpoints have none
        self.bias = state.pop(f"{prefix}.gate.e_score_correction_bias", None)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_topk(logits, self.bias, self.moe)


class DeepseekV3DecoderLayer(MoEDecoderLayer):
    attention_cls = MLAAttention
    block_cls = DeepseekV3MoE


class DeepseekV3ForCausalLM(MoEForCausalLM):
    layer_cls = DeepseekV3DecoderLayer

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor]) -> None:
        # Checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the
        # decoder (model.layers.{num_layers}...); transformers ignores them, so do we.
        state = {name: w for name, w in state.items() if _layer_of(name) < args.num_layers}
        super().__init__(args, state)

    @staticmethod
    def rope_cache(args: ModelArgs) -> torch.Tensor:
        dim = args.mla.qk_rope_head_dim
        scaling = args.rope_scaling
        if scaling is None:
            return rope_cos_sin_cache(dim, args.max_position_embeddings, args.rope_theta)
        inv_freq, factor = yarn_inv_freq(dim, args.rope_theta, scaling,
                                         args.max_position_embeddings)
        cache = rope_cos_sin_cache(dim, args.max_position_embeddings, inv_freq=inv_freq)
        return cache * factor if factor != 1.0 else cache


def _layer_of(name: str) -> int:
    """Decoder layer index of a `model.layers.{i}.` weight; -1 for the others."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1


def yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any],
                  max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN rope as transformers computes it: (inv_freq [dim / 2], cos/sin scale)."""
    factor = scaling.get("factor") or \
        max_position_embeddings / scaling["original_max_position_embeddings"]
    original = scaling["original_max_position_embeddings"]
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                            if mscale and mscale_all else yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) \
        + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
