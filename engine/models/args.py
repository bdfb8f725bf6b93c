"""Model hyper-parameters: `ModelArgs` (one frozen object per model), the architecture tables,
and the one translation of a Hugging Face config.json into it (rope included).

A leaf: it imports nothing of engine/models, so every model file and the loaders can depend
on it without a cycle. The GGUF metadata translation (engine/models/gguf_file.py) builds the
same config dict and hands it to `hf_config_to_args`, so both formats share one parser.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

DENSE_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")  # config.json model_type
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2",  # engine/models/moe.py
             "deepseek_v3")
DEEPSEEK_ARCHS = ("deepseek_v2", "deepseek_v3")  # MLA: engine/models/deepseek_v3.py
SUPPORTED_ARCHS = DENSE_ARCHS + MOE_ARCHS
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types values


class ModelLoadError(ValueError):
    """The model cannot be loaded: missing files, unknown architecture, bad metadata."""


@dataclasses.dataclass(frozen=True)
class MoEArgs:
    num_experts: int  # routed experts per MoE layer
    top_k: int
    intermediate_size: int  # of one routed expert
    moe_layers: tuple[int, ...]  # decoder layers whose MLP is a MoE block (others are dense)
    norm_topk_prob: bool  # renormalise the top-k weights to sum to 1
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ gate) scales the shared expert
    num_groups: int = 1  # DeepSeek-V3 grouped routing: experts split into groups, ...
    topk_groups: int = 1  # ... tokens pick experts from their best `topk_groups` groups only
    routed_scaling_factor: float = 1.0  # multiplies the routed weights (after renormalising)
    # DeepSeek routing scores: "sigmoid" (V3: groups ranked by their two best biased scores)
    # or "softmax" (V2 / V2.5: groups ranked by their best score)
    scoring: str = "sigmoid"

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelLoadError(f"top_k {self.top_k} must be in [1, {self.num_experts}]")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ModelLoadError(f"{self.num_experts} experts cannot form {self.num_groups} "
                                 f"groups with {self.topk_groups} chosen")
        if self.scoring not in ("sigmoid", "softmax"):
            raise ModelLoadError(f"routing scoring {self.scoring!r} is not supported; "
                                 "sigmoid or softmax is")


@dataclasses.dataclass(frozen=True)
class MLAArgs:
    """DeepSeek multi-head latent attention (see engine/models/deepseek_v3.py)."""
    q_lora_rank: int | None  # None: q is one projection, no low-rank factorisation
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's rope dims come in (even, odd) pairs


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Layer i attends to the last `sliding_window` positions when layer_types[i] is SLIDING
    # (a query at p sees keys in (p - sliding_window, p]), to all of them when FULL.
    # () means every layer is FULL.
    sliding_window: int | None = None
    moe: MoEArgs | None = None  # routed experts (engine/models/moe.py)
    mla: MLAArgs | None = None  # multi-head latent attention (DeepSeek-V3)
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"  # MLP gate activation: silu, or gelu_pytorch_tanh (Gemma 3)
    # Gemma 3 only
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5, not head_dim's
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # rope base of the sliding layers (no scaling)

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelLoadError(
                f"{len(self.layer_types)} layer_types for {self.num_layers} layers")
        unknown = set(self.layer_types) - {FULL, SLIDING}
        if unknown:
            raise ModelLoadError(f"unknown layer_types {sorted(unknown)}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ModelLoadError("sliding_attention layers but no sliding_window")

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer: its sliding window, or None for full attention."""
        types = self.layer_types or (FULL,) * self.num_layers
        return [self.sliding_window if t == SLIDING else None for t in types]


# ---------------------------------------------------------------------------- config.json
def hf_config_to_args(config: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a Hugging Face config.json (as a dict), any supported model_type."""
    arch = config.get("model_type")
    if arch == "gemma3":
        raise ModelLoadError("multimodal Gemma 3 (model_type gemma3) is not supported; "
                             "use a text-only checkpoint (model_type gemma3_text)")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"unsupported architecture {arch!r} (model_type in config.json); "
                             f"supported: {', '.join(SUPPORTED_ARCHS)}")
    if arch in MOE_ARCHS:
        return _moe_config_to_args(config)
    return _dense_config_to_args(config)


def _common_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The fields every architecture reads the same way."""
    heads = config["num_attention_heads"]
    return dict(
        arch=config["model_type"], vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        bos_token_id=config.get("bos_token_id"), eos_token_id=_first(config.get("eos_token_id")))


def _dense_config_to_args(config: dict[str, Any]) -> ModelArgs:
    arch = config["model_type"]
    if arch == "gemma3_text":
        rope_theta, rope_scaling, extra = _gemma3_args(config)
    else:
        rope_theta, rope_scaling = parse_rope(config)
        rope_scaling = dense_rope_scaling(config, float(rope_theta), rope_scaling)
        extra = {}
    window, layer_types = _sliding_layers(arch, config)
    return ModelArgs(
        **_common_fields(config), intermediate_size=config["intermediate_size"],
        rope_theta=float(rope_theta),
        tie_word_embeddings=config.get("tie_word_embeddings", arch == "gemma3_text"),
        attention_bias=config.get("attention_bias", arch == "qwen2"),
        qk_norm=arch in ("qwen3", "gemma3_text"), rope_scaling=rope_scaling,
        sliding_window=window, layer_types=layer_types, **extra,
    )


def parse_rope(config: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, scaling parameters or None) from the old layout (rope_theta +
    rope_scaling), the rope_parameters one, or both (rope_scaling wins key by key). The
    scaling dict always carries "rope_type" (old files name it "type")."""
    params = dict(config.get("rope_parameters") or {})
    params.update(config.get("rope_scaling") or {})
    theta = config.get("rope_theta") or params.get("rope_theta", 10000.0)
    kind = _rope_type(params)
    return theta, ({**params, "rope_type": kind} if kind != "default" else None)


DENSE_ROPE_TYPES = ("linear", "llama3", "yarn")  # llama / mistral / qwen2 / qwen3


def dense_rope_scaling(config: dict[str, Any], theta: float, scaling: dict | None
                       ) -> dict | None:
    """A Llama-shaped model's rope scaling with what engine/models/llama.py applies added:
    `freq_factors`, one divisor of the default frequency per rotary pair, and, for yarn,
    `attention_factor`, the cos/sin scale; both as transformers computes them. Scaling that
    depends on the sequence ("dynamic", "longrope") or is unknown is refused, not ignored."""
    if scaling is None or "freq_factors" in scaling:  # a GGUF file's rope_freqs: given
        return scaling
    kind, arch = scaling["rope_type"], config["model_type"]
    if kind not in DENSE_ROPE_TYPES:
        raise ModelLoadError(f"{arch} with rope_type {kind!r} is not supported (rope_scaling "
                             f"in config.json); supported: default, {', '.join(DENSE_ROPE_TYPES)}")
    if scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{arch} with partial_rotary_factor is not supported")
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if kind == "linear":
        return {**scaling, "freq_factors": (float(scaling["factor"]),) * (dim // 2)}
    if kind == "llama3":
        return {**scaling, "freq_factors": llama3_freq_factors(dim, theta, scaling)}
    factors, attention_factor = yarn_freq_factors(
        dim, theta, scaling, config.get("max_position_embeddings", 2048))
    return {**scaling, "freq_factors": factors, "attention_factor": attention_factor}


def llama3_freq_factors(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[float, ...]:
    """Llama 3.1's rope, per rotary pair: 1 for short wavelengths (< original /
    high_freq_factor), `factor` for long ones (> original / low_freq_factor), between them
    the inverse of the blend (1 - s) / factor + s, s = (original / wavelength - low) /
    (high - low) (what llama.cpp stores as rope_freqs.weight)."""
    original = scaling["original_max_position_embeddings"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    out = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi * theta ** (i / dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(float(factor))
        else:
            s = (original / wavelength - low) / (high - low)
            out.append(1.0 / ((1 - s) / factor + s))
    return tuple(out)


def yarn_freq_factors(dim: int, theta: float, scaling: dict[str, Any], max_positions: int
                      ) -> tuple[tuple[float, ...], float]:
    """YaRN as transformers computes it, as (per-pair divisors, cos/sin scale): pair i's
    frequency is blended from the interpolated (/ factor) and the original one by a ramp
    over the pairs between the beta_fast and beta_slow correction dims."""
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                            if mscale and mscale_all else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramps = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)]
    return tuple(1.0 / (r / factor + 1 - r) for r in ramps), float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _sliding_layers(arch: str, config: dict[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer_types) as transformers' config classes derive them."""
    num_layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    if arch == "mistral":  # MistralConfig ignores layer_types: one window for every layer
        return (window, (SLIDING,) * num_layers) if window else (None, ())
    if arch in ("qwen2", "qwen3"):
        window = window if config.get("use_sliding_window", False) else None
        first_sliding = config.get("max_window_layers", 28)
        default = [SLIDING if window is not None and i >= first_sliding else FULL
                   for i in range(num_layers)]
    elif arch == "gemma3_text":
        if config.get("use_bidirectional_attention"):
            raise ModelLoadError("Gemma 3 with use_bidirectional_attention is not supported")
        pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
        default = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    else:
        return None, ()
    layer_types = tuple(config.get("layer_types") or default)
    return (window if SLIDING in layer_types else None), layer_types


def _gemma3_args(config: dict[str, Any]) -> tuple[float, dict | None, dict[str, Any]]:
    """Gemma 3's rope (global layers: rope_theta + scaling; local layers: their own base)
    and attention extras, from the old flat keys or rope_parameters per layer type."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"Gemma 3 with hidden_activation {act!r} is not supported")
    rope_params = config.get("rope_parameters") or {}
    local = rope_params.get("sliding_attention") or {}
    full = dict(rope_params.get("full_attention") or {})
    full.update(config.get("rope_scaling") or {})
    rope_theta = full.get("rope_theta") or config.get("rope_theta") or 1_000_000.0
    rope_scaling = full if _rope_type(full) != "default" else None
    if rope_scaling is not None and _rope_type(full) != "linear":
        raise ModelLoadError(f"Gemma 3 with rope type {_rope_type(full)!r} is not supported")
    if _rope_type(local) != "default":
        raise ModelLoadError("Gemma 3 with scaled rope on the sliding layers is not supported")
    extra = dict(
        hidden_act=act, query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
        # attn_logit_softcapping is read by transformers' Gemma3Attention but never applied
        # (unlike Gemma 2), so it is ignored here too: the output must equal transformers'
        final_logit_softcapping=config.get("final_logit_softcapping"),
        rope_local_theta=float(local.get("rope_theta") or config.get("rope_local_base_freq")
                               or 10_000.0))
    return rope_theta, rope_scaling, extra


def _rope_type(params: dict[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


# ---------------------------------------------------------------------------- MoE configs
def _moe_config_to_args(config: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a Mixtral / Qwen2-MoE / Qwen3-MoE / DeepSeek-V3 config.json."""
    arch = config["model_type"]
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{arch} with hidden_act {config['hidden_act']!r} is not supported")
    if config.get("sliding_window") and config.get("use_sliding_window", arch == "mixtral"):
        raise ModelLoadError(f"{arch} with a sliding window is not supported")
    rope_theta, rope_scaling = parse_rope(config)
    if rope_scaling is not None and (arch not in DEEPSEEK_ARCHS
                                     or rope_scaling["rope_type"] != "yarn"):
        raise ModelLoadError(f"{arch} with rope scaling {rope_scaling} is not supported")
    fields = dict(
        **_common_fields(config), intermediate_size=config.get("intermediate_size", 0),
        rope_theta=float(rope_theta),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=config.get("qkv_bias", True) if arch == "qwen2_moe"
        else config.get("attention_bias", False),
        qk_norm=arch == "qwen3_moe", rope_scaling=rope_scaling, moe=_moe_args(arch, config))
    if arch in DEEPSEEK_ARCHS:
        fields.update(_mla_fields(config))
    return ModelArgs(**fields)


def _moe_args(arch: str, config: dict[str, Any]) -> MoEArgs:
    num_layers = config["num_hidden_layers"]
    num_experts = config.get("num_local_experts") or config.get("num_experts") \
        or config.get("n_routed_experts")
    common = dict(num_experts=num_experts, top_k=config["num_experts_per_tok"])
    if arch == "mixtral":
        return MoEArgs(**common, intermediate_size=config["intermediate_size"],
                       moe_layers=tuple(range(num_layers)), norm_topk_prob=True)
    if arch in DEEPSEEK_ARCHS:
        return _deepseek_moe_args(arch, config, common)
    dense = set(config.get("mlp_only_layers") or ())
    step = config.get("decoder_sparse_step", 1)
    moe_layers = tuple(i for i in range(num_layers)
                       if num_experts and i not in dense and (i + 1) % step == 0)
    shared = config.get("shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0
    return MoEArgs(**common, intermediate_size=config["moe_intermediate_size"],
                   moe_layers=moe_layers, norm_topk_prob=config.get("norm_topk_prob", False),
                   shared_intermediate_size=shared, shared_expert_gate=bool(shared))


def _deepseek_moe_args(arch: str, config: dict[str, Any], common: dict[str, Any]) -> MoEArgs:
    """V3: sigmoid scores (config.json's scoring_func), grouped. V2 / V2.5: softmax scores,
    grouped only with topk_method group_limited_greedy; top-k weights times
    routed_scaling_factor, never renormalised (DeepSeek's V2 code renormalises and then
    skips the scaling, transformers' ignores norm_topk_prob: such a config is refused)."""
    scoring = (config.get("scoring_func") or "sigmoid") if arch == "deepseek_v3" else "softmax"
    groups = (config.get("n_group") or 1, config.get("topk_group") or 1)
    if arch == "deepseek_v2":
        method = config.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ModelLoadError(f"deepseek_v2 with topk_method {method!r} is not supported")
        if config.get("norm_topk_prob"):
            raise ModelLoadError("deepseek_v2 with norm_topk_prob is not supported")
        groups = groups if method == "group_limited_greedy" else (1, 1)
    return MoEArgs(
        **common, intermediate_size=config["moe_intermediate_size"],
        moe_layers=tuple(range(config.get("first_k_dense_replace", 0),
                               config["num_hidden_layers"])),
        norm_topk_prob=config.get("norm_topk_prob", arch == "deepseek_v3") or False,
        shared_intermediate_size=config["moe_intermediate_size"]
        * (config.get("n_shared_experts") or 0),
        num_groups=groups[0], topk_groups=groups[1], scoring=scoring,
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))


def _mla_fields(config: dict[str, Any]) -> dict[str, Any]:
    """MLA args plus the paged-cache geometry they imply (see engine/models/deepseek_v3.py):
    one kv head whose k and v planes each hold half of the latent [c_kv | k_pe]."""
    mla = MLAArgs(q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
                  qk_nope_head_dim=config["qk_nope_head_dim"],
                  qk_rope_head_dim=config["qk_rope_head_dim"],
                  v_head_dim=config.get("v_head_dim") or config["qk_nope_head_dim"],
                  rope_interleave=config.get("rope_interleave", True))
    latent = mla.kv_lora_rank + mla.qk_rope_head_dim
    if latent % 2:
        raise ModelLoadError(f"kv_lora_rank + qk_rope_head_dim = {latent} must be even "
                             "(the latent is split over the cache's k and v planes)")
    return dict(mla=mla, num_kv_heads=1, head_dim=latent // 2)


def _first(value):
    return value[0] if isinstance(value, list) and value else value
