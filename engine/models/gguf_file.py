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
               "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
ROTARY_INTERLEAVED = ("llama", "mistral", "mixtral")  # model types whose q/k rows llama.cpp permuted
NORM_OFFSET = {"gemma3_text": 1.0}  # stored norm = weight + offset
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's default: every 6th layer global
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62  # llama.cpp: the 27B model scales attention by hidden / heads
ROPE_FREQS = "rope_freqs.weight"
ROPE_FREQS_TYPES = ("llama", "mistral")  # model types whose rotary applies rope_freqs
CONFIG_TENSORS = (ROPE_FREQS,)  # tensors read into the config, not the state dict

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
    if num_experts:
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
    if base in _EXPERTS:
        prefix, names = _EXPERT_NAMES.get(model_type, _QWEN_EXPERTS)
        return TensorName("", f"model.layers.{layer}.{prefix}",
                          f"{names[_EXPERTS[base]]}.{suffix}")
    table = {"gemma3_text": _GEMMA3_LAYER, "mixtral": _MIXTRAL_LAYER}.get(model_type, _LAYER)
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
    if ".mlp." in hf_name and ".experts." not in hf_name and ".shared_expert." not in hf_name:
        table |= {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                  "down_proj": (hidden, inter)}
    if base.endswith("norm") and base not in ("q_norm", "k_norm"):
        return (hidden,)
    if args.mla is not None and base in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return None
    return table.get(base) if hf_name.endswith(".weight") else None


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
