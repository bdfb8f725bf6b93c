"""What a GGUF file means to Duplex: its metadata as a Hugging Face config (handed to the one
translation in engine/models/args.py), its tensor names as Hugging Face parameter names, and
the checks that turn a file Duplex cannot run into one `ModelLoadError` at start-up.

Facts of the format (llama.cpp's converter; gguf.constants names them):
* shapes are stored fastest axis first: a `[out, in]` weight has GGUF shape (in, out);
* llama-architecture files (Llama, Mistral, Mixtral) interleave the rows of q and k per head
  (rotary pairs (2i, 2i+1)); Hugging Face pairs (i, i + d/2), see `unpermute_rotary`;
* Gemma norms are stored as (1 + weight), the factor ggml multiplies by (`NORM_OFFSET`);
* routed experts are stacked: `blk.N.ffn_{gate,up}_exps` is [experts, inter, hidden] and
  `ffn_down_exps` [experts, hidden, inter]; `ffn_gate_inp` is the router;
* Mixtral is architecture "llama" with `llama.expert_count` > 0;
* deepseek2 (DeepSeek V2 / V3 / R1, MLA) keeps the checkpoint's rows (no q/k permutation:
  ggml's "normal" rope pairs (2i, 2i+1), the checkpoint's rope_interleave); newer files
  describe the absorbed form (head_count_kv 1, key_length kv_lora_rank + rope, value_length
  kv_lora_rank, the per-head sizes in key_length_mla / value_length_mla) and split kv_b_proj
  into `attn_k_b` [heads, kv_lora_rank, nope] (transposed) and `attn_v_b` [heads, v, rank];
  the router's correction bias is `exp_probs_b.bias`; yarn's mscale_all_dim is stored as
  `rope.scaling.yarn_log_multiplier` = 0.1 * mscale_all_dim;
* Llama 3.1 / 3.2 ("llama3" rope) carry no rope.scaling keys but a tensor `rope_freqs.weight`:
  one divisor per rotary pair (head_dim / 2 values, ggml's freq_factors), applied as
  `inv_freq / rope_freqs`; it is configuration, not a weight (`CONFIG_TENSORS`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from duplex.engine.models.args import FULL, SLIDING, ModelArgs, ModelLoadError

# general.architecture -> config.json model_type (llama becomes mixtral when it has experts)
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
               "deepseek2": "deepseek_v3"}
ROTARY_INTERLEAVED = ("llama", "mistral", "mixtral")  # model types whose q/k rows llama.cpp permuted
NORM_OFFSET = {"gemma3_text": 1.0}  # stored norm = weight + offset
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's default: every 6th layer global
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62  # llama.cpp: the 27B model scales attention by hidden / heads
ROPE_FREQS = "rope_freqs.weight"
ROPE_FREQS_TYPES = ("llama", "mistral")  # model types whose rotary applies rope_freqs
CONFIG_TENSORS = (ROPE_FREQS,)  # tensors read into the config, not the state dict
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # {arch}.expert_gating_func (absent: softmax, V2)
YARN_LOG_MUL_PER_MSCALE = 0.1  # deepseek2: yarn_log_multiplier = 0.1 * mscale_all_dim

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_GEMMA3_LAYER = _LAYER | {"post_attention_norm": "post_attention_layernorm",
                          "ffn_norm": "pre_feedforward_layernorm",
                          "post_ffw_norm": "post_feedforward_layernorm"}
_MIXTRAL_LAYER = _LAYER | {"ffn_gate_inp": "block_sparse_moe.gate"}
_DEEPSEEK2_LAYER = {
    **{k: _LAYER[k] for k in ("attn_norm", "ffn_norm", "attn_q", "attn_output", "ffn_gate",
                              "ffn_up", "ffn_down", "ffn_gate_inp")},
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",  # see complete_mla
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj"}
_ROUTER_BIAS = ("exp_probs_b", "mlp.gate.e_score_correction_bias")  # GGUF base, HF name
_EXPERTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}  # index into expert names
_EXPERT_NAMES = {"mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2"))}
_QWEN_EXPERTS = ("mlp.experts", ("gate_proj", "up_proj", "down_proj"))


class TensorName(NamedTuple):
    """Where a GGUF tensor goes: one HF name, or (stacked experts) `{prefix}.{e}.{suffix}`."""
    hf_name: str
    expert_prefix: str | None = None  # set for stacked experts: split along axis 0
    expert_suffix: str = ""


def open_reader(path: str):
    """The metadata and tensors of `path` (engine/models/gguf_reader.py); a file that is not a
    complete GGUF is a ModelLoadError."""
    from duplex.engine.models.gguf_reader import read_gguf

    return read_gguf(path)


def hf_config(path: str, meta: dict[str, Any], shapes: dict[str, tuple[int, ...]],
              rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """The config.json equivalent of a GGUF file's metadata (`meta`), tensor shapes
    (`shapes`: GGUF name -> row-major shape) and `rope_freqs.weight` values (if any)."""
    arch = meta.get("general.architecture")
    if arch not in MODEL_TYPES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; "
                             f"supported: {', '.join(MODEL_TYPES)}")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    num_experts = int(get("expert_count", 0) or 0)
    model_type = "mixtral" if arch == "llama" and num_experts else MODEL_TYPES[arch]
    config = dict(
        model_type=model_type, hidden_size=hidden, num_attention_heads=heads,
        vocab_size=int(get("vocab_size") or shapes["token_embd.weight"][0]),
        intermediate_size=int(get("feed_forward_length", 0) or 0),
        num_hidden_layers=int(get("block_count")),
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes, qkv_bias="blk.0.attn_q.bias" in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))
    scaling = _rope_scaling(get)
    if scaling:
        config["rope_scaling"] = scaling
    if rope_freqs is not None:
        config["rope_scaling"] = _freq_factors(path, config, rope_freqs)
    if model_type == "gemma3_text":
        config.update(_gemma3_config(config, get))
    if model_type == "deepseek_v3":
        config.update(_deepseek2_config(path, config, get))
    elif num_experts:
        config.update(_moe_config(model_type, config, get, shapes, num_experts))
    return config


def _rope_scaling(get) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = dict(rope_type=kind, factor=float(get("rope.scaling.factor", 1.0)))
    original = get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _freq_factors(path: str, config: dict[str, Any], rope_freqs: np.ndarray) -> dict[str, Any]:
    """The rope scaling of a file with `rope_freqs.weight`: the stored per-pair divisors
    themselves (engine/models/llama.py applies them), not the parameters they came from."""
    if config["model_type"] not in ROPE_FREQS_TYPES:
        raise ModelLoadError(f"{path}: tensor {ROPE_FREQS} (per-pair rope factors) is "
                             f"supported for {', '.join(ROPE_FREQS_TYPES)}, not "
                             f"{config['model_type']}")
    factors = np.asarray(rope_freqs, dtype=np.float32).reshape(-1)
    pairs = config["head_dim"] // 2
    if factors.size != pairs or not np.all(np.isfinite(factors) & (factors > 0)):
        raise ModelLoadError(f"{path}: tensor {ROPE_FREQS} must hold {pairs} positive "
                             f"finite factors (one per rotary pair); it holds {factors.size} "
                             f"values, from {factors.min(initial=np.inf)} to "
                             f"{factors.max(initial=-np.inf)}")
    return dict(rope_type="llama3", freq_factors=tuple(float(f) for f in factors))


def _gemma3_config(config: dict[str, Any], get) -> dict[str, Any]:
    """Gemma 3's window and which layers slide: `sliding_window_pattern` is a period (every
    n-th layer global) or one flag per layer (true: sliding)."""
    num_layers = config["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern") or GEMMA3_SLIDING_PATTERN
    layers = dict(layer_types=[SLIDING if flag else FULL for flag in pattern]) \
        if isinstance(pattern, list) else dict(sliding_window_pattern=int(pattern))
    scalar = config["hidden_size"] // config["num_attention_heads"] \
        if num_layers == GEMMA3_27B_LAYERS else config["head_dim"]
    return dict(**layers, sliding_window=int(get("attention.sliding_window", 512)),
                query_pre_attn_scalar=scalar,
                final_logit_softcapping=get("final_logit_softcapping"),
                rope_local_base_freq=float(get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
                hidden_activation="gelu_pytorch_tanh")


def _deepseek2_config(path: str, config: dict[str, Any], get) -> dict[str, Any]:
    """DeepSeek V2 / V3 metadata as DeepseekV3Config keys (MLA sizes, routed experts, yarn)."""
    gating = int(get("expert_gating_func") or GATING_SOFTMAX)
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
        raise ModelLoadError(f"{path}: deepseek2 with expert_gating_func {gating} is not "
                             "supported; softmax (1, DeepSeek V2 / V2.5) and sigmoid (2, "
                             "DeepSeek V3 / R1) are")
    rope = int(get("rope.dimension_count"))
    qk_head = int(get("attention.key_length_mla") or get("attention.key_length"))
    config = dict(
        q_lora_rank=int(get("attention.q_lora_rank", 0) or 0) or None,
        kv_lora_rank=int(get("attention.kv_lora_rank")), qk_rope_head_dim=rope,
        qk_nope_head_dim=qk_head - rope, rope_interleave=True,
        v_head_dim=int(get("attention.value_length_mla") or get("attention.value_length")),
        n_routed_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
        moe_intermediate_size=int(get("expert_feed_forward_length")),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        n_shared_experts=int(get("expert_shared_count", 0)),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        n_group=int(get("expert_group_count", 0) or 1),
        topk_group=int(get("expert_group_used_count", 0) or 1),
        scoring_func="softmax" if gating == GATING_SOFTMAX else "sigmoid")
    scaling = _rope_scaling(get)
    if scaling is not None and scaling["rope_type"] == "yarn":
        # llama.cpp keeps one mscale: the cos/sin factor mscale / mscale_all_dim is 1
        mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / YARN_LOG_MUL_PER_MSCALE
        config["rope_scaling"] = scaling | dict(
            mscale=mscale, mscale_all_dim=mscale, attention_factor=1.0,
            beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)))
    return config


def _moe_config(model_type: str, config: dict[str, Any], get, shapes, num_experts: int
                ) -> dict[str, Any]:
    """Expert counts and sizes; which layers are MoE comes from where a router is."""
    num_layers = config["num_hidden_layers"]
    experts = dict(num_local_experts=num_experts, num_experts=num_experts,
                   num_experts_per_tok=int(get("expert_used_count")))
    if model_type == "mixtral":
        return experts
    up = shapes.get("blk.%d.ffn_up_exps.weight" % _first_moe_layer(shapes, num_layers))
    shared = shapes.get("blk.%d.ffn_up_shexp.weight" % _first_moe_layer(shapes, num_layers))
    return experts | dict(
        moe_intermediate_size=int(get("expert_feed_forward_length", 0) or up[1]),
        shared_expert_intermediate_size=int(
            get("expert_shared_feed_forward_length", 0) or (shared[0] if shared else 0)),
        norm_topk_prob=bool(get("expert_weights_norm", model_type == "qwen3_moe")),
        mlp_only_layers=[i for i in range(num_layers)
                         if f"blk.{i}.ffn_gate_inp.weight" not in shapes])


def _first_moe_layer(shapes, num_layers: int) -> int:
    return next((i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes), 0)


def tensor_name(name: str, model_type: str) -> TensorName:
    """The HF parameter name(s) of GGUF tensor `name` in a model of `model_type`."""
    parts = name.split(".")
    if parts[0] != "blk":
        if parts[0] not in _TOP:
            raise ModelLoadError(f"GGUF tensor {name!r} is not supported for {model_type}")
        return TensorName(f"{_TOP[parts[0]]}.{parts[-1]}")
    layer, base, suffix = parts[1], parts[2], parts[-1]
    if base == _ROUTER_BIAS[0] and model_type == "deepseek_v3":
        return TensorName(f"model.layers.{layer}.{_ROUTER_BIAS[1]}")
    if base in _EXPERTS:
        prefix, names = _EXPERT_NAMES.get(model_type, _QWEN_EXPERTS)
        return TensorName("", f"model.layers.{layer}.{prefix}",
                          f"{names[_EXPERTS[base]]}.{suffix}")
    table = {"gemma3_text": _GEMMA3_LAYER, "mixtral": _MIXTRAL_LAYER,
             "deepseek_v3": _DEEPSEEK2_LAYER}.get(model_type, _LAYER)
    if base not in table:
        raise ModelLoadError(f"GGUF tensor {name!r} is not supported for {model_type}")
    return TensorName(f"model.layers.{layer}.{table[base]}.{suffix}")


def expected_shape(hf_name: str, args: ModelArgs) -> tuple[int, ...] | None:
    """The row-major shape `args` implies for an HF weight (None: not checked here)."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    hidden, inter = args.hidden_size, args.intermediate_size
    base = hf_name.rsplit(".", 1)[0].split(".")[-1]
    table = {"embed_tokens": (args.vocab_size, hidden), "lm_head": (args.vocab_size, hidden),
             "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
             "o_proj": (hidden, q), "q_norm": (args.head_dim,), "k_norm": (args.head_dim,)}
    if ".mlp." in hf_name and ".experts." not in hf_name and ".shared_expert" not in hf_name:
        table |= {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                  "down_proj": (hidden, inter)}
    if args.mla is not None:
        table |= _mla_shapes(args)
    if not hf_name.endswith(".weight"):
        return None
    return table.get(base, (hidden,) if base.endswith("norm") else None)


def _mla_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Row-major shapes of the MLA projections (engine/models/deepseek_v3.py)."""
    mla, heads, hidden = args.mla, args.num_heads, args.hidden_size
    qk, rank = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.kv_lora_rank
    q_in = mla.q_lora_rank or hidden
    return {"q_proj": (heads * qk, hidden), "q_b_proj": (heads * qk, q_in),
            "q_a_proj": (q_in, hidden), "q_a_layernorm": (q_in,),
            "kv_a_proj_with_mqa": (rank + mla.qk_rope_head_dim, hidden),
            "kv_a_layernorm": (rank,),
            "kv_b_proj": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), rank),
            "k_b_proj": (heads, rank, mla.qk_nope_head_dim),
            "v_b_proj": (heads, mla.v_head_dim, rank), "o_proj": (hidden, heads * mla.v_head_dim)}


def check_shape(gguf_name: str, hf_name: str, shape: tuple[int, ...], args: ModelArgs,
                path: str) -> None:
    expected = expected_shape(hf_name, args)
    if expected is not None and tuple(shape) != expected:
        raise ModelLoadError(f"{path}: tensor {gguf_name} has shape {list(shape)}, the "
                             f"metadata implies {list(expected)}")


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows so rotary pairs are (i, i + d/2) again."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rotary_rows(hf_name: str, args: ModelArgs):
    """The row permutation a q/k projection of an interleaved-rotary file needs (or identity)."""
    if args.arch in ROTARY_INTERLEAVED and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = args.num_heads if "q_proj" in hf_name else args.num_kv_heads
        return lambda rows: unpermute_rotary(rows, heads)
    return lambda rows: rows


def norm_offset(hf_name: str, args: ModelArgs) -> float:
    """What to subtract from a stored norm weight to get the HF one."""
    return NORM_OFFSET.get(args.arch, 0.0) if hf_name.endswith("norm.weight") else 0.0


# ---------------------------------------------------------------------------- completeness
def check_complete(present: set[str], args: ModelArgs, path: str) -> None:
    """The file has every weight tensor the model needs: else one ModelLoadError naming the
    first one missing. Each need is a list of alternatives (deepseek2's kv_b_proj whole, or
    split into k_b / v_b), each alternative a tuple of tensors all required."""
    needs = [[("token_embd.weight",)], [("output_norm.weight",)]]
    for i in range(args.num_layers):
        needs += [[(f"blk.{i}.{base}.weight",)] for base in _layer_needs(args, i)]
        if args.mla is not None:
            needs.append([(f"blk.{i}.attn_kv_b.weight",),
                          (f"blk.{i}.attn_k_b.weight", f"blk.{i}.attn_v_b.weight")])
    for alternatives in needs:
        best = max(alternatives, key=lambda names: sum(n in present for n in names))
        missing = [n for n in best if n not in present]
        if missing:
            raise ModelLoadError(f"{path}: tensor {missing[0]} is missing (the metadata "
                                 f"implies it)")


def _layer_needs(args: ModelArgs, layer: int) -> list[str]:
    """The GGUF base names (`blk.N.{base}.weight`) layer `layer` must have; biases and
    deepseek2's exp_probs_b (see complete_mla) are not counted."""
    needs = ["attn_norm", "attn_output"]
    if args.mla is None:
        needs += ["attn_q", "attn_k", "attn_v"] + (["attn_q_norm", "attn_k_norm"]
                                                   if args.qk_norm else [])
    else:
        needs += ["attn_kv_a_mqa", "attn_kv_a_norm"] + (
            ["attn_q_a", "attn_q_a_norm", "attn_q_b"] if args.mla.q_lora_rank else ["attn_q"])
    needs += ["post_attention_norm", "ffn_norm", "post_ffw_norm"] \
        if args.arch == "gemma3_text" else ["ffn_norm"]
    moe = args.moe
    if moe is None or layer not in moe.moe_layers:
        return needs + ["ffn_gate", "ffn_up", "ffn_down"]
    needs += ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
    if moe.shared_intermediate_size:
        needs += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    return needs + (["ffn_gate_inp_shexp"] if moe.shared_expert_gate else [])


def complete_mla(state: dict[str, Any], args: ModelArgs) -> None:
    """The state dict of a deepseek2 file as the checkpoint's: split `k_b_proj`
    [heads, rank, nope] / `v_b_proj` [heads, v, rank] (newer files) put back together as
    kv_b_proj [heads * (nope + v), rank], and a router without exp_probs_b given a zero
    correction bias (llama.cpp's reading: the tensor is optional)."""
    import torch

    if args.mla is None:
        return
    embed = state["model.embed_tokens.weight"]
    for i in args.moe.moe_layers:
        bias = f"model.layers.{i}.{_ROUTER_BIAS[1]}"
        if bias not in state:  # made where the weights are, placed with them
            state[bias] = torch.zeros(args.moe.num_experts, dtype=embed.dtype,
                                      device=embed.device)
    for i in range(args.num_layers):
        prefix = f"model.layers.{i}.self_attn"
        if f"{prefix}.k_b_proj.weight" not in state:
            continue
        k_b = state.pop(f"{prefix}.k_b_proj.weight")
        v_b = state.pop(f"{prefix}.v_b_proj.weight")
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [heads, nope + v, rank]
        state[f"{prefix}.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1]).contiguous()
