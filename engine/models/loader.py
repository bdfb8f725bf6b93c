"""Model loading: GGUF files (dequantized with `gguf`) and local Hugging Face directories.

Produces `ModelArgs` (the architecture's hyper-parameters, one frozen object) and a state
dict in Hugging Face parameter names, whatever the source format, so each model file under
engine/models/ loads one naming scheme only. Nothing is ever fetched from a hub.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from duplex.engine.models.gguf_quant import INT4_TYPES, unpack_int4, unpack_q8_0
from duplex.kernels.quant import INT4_GROUP, QuantEmbedding, QuantWeight

if TYPE_CHECKING:
    from duplex.engine.models.moe import MLAArgs, MoEArgs

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")  # config.json model_type
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")  # engine/models/moe.py
_GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")  # general.architecture
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types values


class ModelLoadError(ValueError):
    """The model cannot be loaded: missing files, unknown architecture, bad metadata."""


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


class LoadedModel(NamedTuple):
    args: ModelArgs
    state_dict: dict[str, torch.Tensor]
    identity: str  # digest of the weights: the root of every KV content address
    name: str


def load(path: str, dtype: torch.dtype = torch.float32, progress: bool = True,
         quant: str = "none") -> LoadedModel:
    """quant: "none" (every weight in `dtype`), "auto" (a GGUF file's 4/8-bit linear weights
    stay quantized, see `_gguf_linear`), "int4" or "int8" (every linear weight quantized).
    Quantized weights are `kernels.quant` objects in the state dict; the rest is `dtype`."""
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.endswith(".gguf") and os.path.isfile(path):
        return _load_gguf(path, dtype, progress, quant)
    if os.path.isdir(path):
        return _load_hf_dir(path, dtype, progress, quant)
    raise ModelLoadError(f"not a .gguf file or a Hugging Face model directory: {path}")


QUANT_ARCHS = ("llama", "mistral", "qwen2", "qwen3")  # dense models whose linears may quantize
QUANT_MODES = ("none", "auto", "int4", "int8")


def is_quantizable(name: str) -> bool:
    """A dense linear weight (attention / MLP projections, the output head)."""
    return name == "lm_head.weight" or (name.endswith("_proj.weight") and ".mlp.experts" not in name)


def quantize_float(w: torch.Tensor, quant: str, with_dense: bool = False) -> QuantWeight:
    """A float `[N, K]` weight in the requested scheme (int4 needs K divisible by 32)."""
    if quant == "int4" and w.shape[1] % INT4_GROUP == 0:
        return QuantWeight.int4_from_float(w, with_dense=with_dense)
    return QuantWeight.int8_from_float(w, with_dense=with_dense)


def weights_digest(files: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(files):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------- GGUF
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
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
}


def _load_gguf(path: str, dtype: torch.dtype, progress: bool, quant: str) -> LoadedModel:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = {k: _field_value(f) for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_id")}
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(f"unsupported architecture {arch!r} in {path}; "
                             f"supported: {', '.join(_GGUF_ARCHS)}")
    args = _gguf_args(arch, meta, reader)
    quant = _check_quant(quant, arch)
    state = {}
    for t in tqdm(reader.tensors, desc="loading", unit="tensor", disable=None if progress else True):  # None: on a terminal only
        name = _gguf_to_hf_name(t.name)
        state[name] = _gguf_tensor(t, name, args, dtype, quant)
    if quant != "none" and "lm_head.weight" not in state:  # tied: the head gets its own copy
        state["lm_head.weight"] = _tied_head(state["model.embed_tokens.weight"], quant)
    name = meta.get("general.name") or Path(path).stem
    return LoadedModel(args, state, weights_digest([Path(path)]), str(name))


def _check_quant(quant: str, arch: str) -> str:
    if quant not in QUANT_MODES:
        raise ModelLoadError(f"unknown quantization {quant!r}; one of {', '.join(QUANT_MODES)}")
    if quant in ("int4", "int8") and arch not in QUANT_ARCHS:
        raise ModelLoadError(f"--dtype {quant} is supported for {', '.join(QUANT_ARCHS)}, "
                             f"not {arch}")
    return quant if arch in QUANT_ARCHS else "none"


def _gguf_tensor(t, name: str, args: ModelArgs, dtype: torch.dtype, quant: str):
    """One GGUF tensor as the model will hold it: quantized or dequantized to `dtype`."""
    from gguf import dequantize

    type_name = t.tensor_type.name
    # GGUF shapes are reversed (fastest axis first); numpy data comes out row-major.
    shape = tuple(reversed(t.shape.tolist()))
    permute = _rotary_rows(name, args)
    dense = quant == "auto"  # auto: a bf16 copy too, for batches (kernels.quant)
    if quant != "none" and is_quantizable(name) and type_name in INT4_TYPES and quant != "int8":
        return unpack_int4(type_name, t.data, shape[-1]).map_rows(permute).to_weight(dense)
    if quant != "none" and name == "model.embed_tokens.weight" and type_name == "Q8_0":
        return QuantEmbedding(*unpack_q8_0(t.data, shape[-1]), dtype=dtype)
    array = permute(dequantize(t.data, t.tensor_type).reshape(shape))
    tensor = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
    if quant != "none" and is_quantizable(name) and (quant != "auto" or type_name == "Q8_0"):
        return quantize_float(tensor, "int8" if quant == "auto" else quant, dense)
    return tensor.to(dtype)


def _tied_head(embed, quant: str) -> QuantWeight:
    """The output head of a tied-embedding model, quantized like the file's embedding."""
    table = embed.dequantize() if isinstance(embed, QuantEmbedding) else embed.float()
    return quantize_float(table, "int8" if quant == "auto" else quant, quant == "auto")


def _rotary_rows(name: str, args: ModelArgs):
    """The row permutation a GGUF llama q/k projection needs (identity otherwise)."""
    if args.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = args.num_heads if "q_proj" in name else args.num_kv_heads
        return lambda rows: _unpermute_rotary(rows, heads)
    return lambda rows: rows


def _gguf_args(arch: str, meta: dict[str, Any], reader) -> ModelArgs:
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    vocab = get("vocab_size")
    if vocab is None:
        vocab = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
    return ModelArgs(
        arch=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")), num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=not has_output,
        attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        qk_norm=any(t.name.endswith("attn_q_norm.weight") for t in reader.tensors),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def _gguf_to_hf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], parts[3]
        return f"model.layers.{layer}.{_GGUF_NAMES[base]}.{suffix}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


def _unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows so rotary pairs are (i, i + d/2) again."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field_value(field) -> Any:
    from gguf import GGUFValueType

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.STRING and len(field.data) == 1:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    if field.types[0] == GGUFValueType.ARRAY:
        return None  # vocabularies etc.: the tokenizer reads those
    value = field.parts[field.data[0]]
    return value.tolist()[0] if hasattr(value, "tolist") else value


# ---------------------------------------------------------------------------- HF directory
def _load_hf_dir(path: str, dtype: torch.dtype, progress: bool, quant: str) -> LoadedModel:
    from safetensors.torch import load_file

    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"no config.json in {path}")
    config = json.loads(config_path.read_text())
    args = hf_config_to_args(config)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    quant = _check_quant(quant, args.arch)
    quant = "none" if quant == "auto" else quant  # auto keeps the file's (float) precision
    state = {}
    for f in tqdm(files, desc="loading", unit="file", disable=None if progress else True):  # None: on a terminal only
        for name, tensor in load_file(str(f)).items():
            quantized = quant != "none" and is_quantizable(name)
            state[name] = quantize_float(tensor, quant) if quantized else tensor.to(dtype)
    if quant != "none" and "lm_head.weight" not in state:
        state["lm_head.weight"] = _tied_head(state["model.embed_tokens.weight"], quant)
    return LoadedModel(args, state, weights_digest(files), Path(path).name)


def hf_config_to_args(config: dict[str, Any]) -> ModelArgs:
    arch = config.get("model_type")
    if arch in MOE_ARCHS:
        from duplex.engine.models.moe import moe_config_to_args  # moe imports this module
        return moe_config_to_args(config)
    if arch == "gemma3":
        raise ModelLoadError("multimodal Gemma 3 (model_type gemma3) is not supported; "
                             "use a text-only checkpoint (model_type gemma3_text)")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"unsupported architecture {arch!r} (model_type in config.json); "
                             f"supported: {', '.join(SUPPORTED_ARCHS)}")
    heads = config["num_attention_heads"]
    if arch == "gemma3_text":
        rope_theta, rope_scaling, extra = _gemma3_args(config)
    else:
        rope_theta, rope_scaling = _rope(config)
        extra = {}
    window, layer_types = _sliding_layers(arch, config)
    return ModelArgs(
        arch=arch, vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=config.get("tie_word_embeddings", arch == "gemma3_text"),
        attention_bias=config.get("attention_bias", arch == "qwen2"),
        qk_norm=arch in ("qwen3", "gemma3_text"), rope_scaling=rope_scaling,
        bos_token_id=config.get("bos_token_id"), eos_token_id=_first(config.get("eos_token_id")),
        sliding_window=window, layer_types=layer_types, **extra,
    )


def _rope(config: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either the old or the rope_parameters layout."""
    rope_params = config.get("rope_parameters") or {}
    rope_theta = config.get("rope_theta") or rope_params.get("rope_theta", 10000.0)
    rope_scaling = config.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = rope_params
    return rope_theta, rope_scaling


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
    full = dict(rope_params.get("full_attention") or {})
    local = rope_params.get("sliding_attention") or {}
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


def _first(value):
    return value[0] if isinstance(value, list) and value else value
