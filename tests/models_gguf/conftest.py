"""GGUF test fixtures: tiny random models of every architecture Duplex runs, saved by
transformers as safetensors and written again as GGUF files with the `gguf` package, the way
llama.cpp's converter lays them out (see engine/models/gguf_file.py for the conventions)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

VOCAB = 384
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               initializer_range=0.3, tie_word_embeddings=False, rms_norm_eps=1e-6)
# name -> (transformers config class prefix, GGUF architecture, extra config); spread init (0.3)
# keeps top-k choices and argmax far from ties
TINY = {
    "llama": ("Llama", "llama", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2", "qwen2", dict()),
    "qwen3": ("Qwen3", "qwen3", dict(head_dim=32)),
    "gemma3": ("Gemma3Text", "gemma3", dict(
        head_dim=32, sliding_window=4, layer_types=["sliding_attention", "sliding_attention",
                                                    "full_attention"],
        tie_word_embeddings=True, query_pre_attn_scalar=32, rope_local_base_freq=10000.0)),
    "mixtral": ("Mixtral", "llama", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2Moe", "qwen2moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3Moe", "qwen3moe", dict(
        head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True, mlp_only_layers=[1])),
}
# Llama 3.1-style rope ("llama3"): the rotary pairs past original_max_position_embeddings
# (64 here) are slowed down; llama.cpp writes the per-pair divisors as rope_freqs.weight
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)
TINY["llama3_rope"] = ("Llama", "llama", dict(num_hidden_layers=2, max_position_embeddings=512,
                                              rope_parameters=LLAMA3_ROPE))
# DeepSeek V3 (MLA, grouped sigmoid routing with a correction bias, a dense first layer) and a
# V2-Lite-shaped one (q in one projection, no groups, unnormalised top-k) with yarn rope
_DEEPSEEK = dict(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=16, n_routed_experts=8, n_group=4, topk_group=2,
                 num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=48,
                 first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                 num_key_value_heads=4)  # MLA: transformers' kv heads = heads
TINY["deepseek_v3"] = ("DeepseekV3", "deepseek2", _DEEPSEEK)
TINY["deepseek_lite_yarn"] = ("DeepseekV3", "deepseek2", dict(
    _DEEPSEEK, q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
    routed_scaling_factor=1.0, n_shared_experts=2,  # max_position_embeddings 256 = 4 * 64
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                         original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0,
                         beta_fast=32, beta_slow=1)))
# DeepSeek V2 / V2.5 (softmax routing, unnormalised top-k times routed_scaling_factor): one
# group-limited by each group's best score, one V2-Lite-shaped (plain top-k) with yarn rope
TINY["deepseek_v2"] = ("DeepseekV2", "deepseek2", dict(
    _DEEPSEEK, topk_method="group_limited_greedy", norm_topk_prob=False))
TINY["deepseek_v2_lite_yarn"] = ("DeepseekV2", "deepseek2", dict(
    TINY["deepseek_lite_yarn"][2], topk_method="greedy", routed_scaling_factor=1.5))
_GEMMA_NORM_OFFSET = 1.0  # llama.cpp stores Gemma norms as 1 + weight


def build_hf(name: str, root: Path) -> Path:
    """A tiny random transformers model of family `name`, saved under root/name-hf."""
    import transformers

    prefix, _, extra = TINY[name]
    config = getattr(transformers, f"{prefix}Config")(**{**_COMMON, **extra})
    torch.manual_seed(0)
    model_cls = prefix.removesuffix("Text") + "ForCausalLM"  # Gemma3TextConfig: Gemma3ForCausalLM
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # Gemma's norms start at 0 (a factor of 1): give them real weights
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(0.0, 0.3)
        for bname, buffer in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # zeros after init: make it count
                buffer.normal_(0.0, 0.3)
    path = root / f"{name}-hf"
    model.save_pretrained(path, safe_serialization=True)
    return path


def gguf_name(hf: str, arch: str, model_type: str) -> tuple[str, int | None]:
    """(GGUF tensor name, expert index or None) of an HF checkpoint name."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf], None
    parts = hf.split(".")
    layer, rest = parts[2], ".".join(parts[3:])
    layer_names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
        "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp"}
    if model_type == "gemma3_text":
        layer_names |= {"post_attention_layernorm": "post_attention_norm",
                        "pre_feedforward_layernorm": "ffn_norm",
                        "post_feedforward_layernorm": "post_ffw_norm"}
    module, suffix = rest.rsplit(".", 1)
    if ".experts." in module:  # mlp.experts.3.gate_proj / block_sparse_moe.experts.3.w1
        expert, proj = module.split(".experts.")[1].split(".")
        kind = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}[proj]
        return f"blk.{layer}.ffn_{kind}_exps.{suffix}", int(expert)
    return f"blk.{layer}.{layer_names[module]}.{suffix}", None


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: rotary pairs (i, i + d/2) interleaved as (2i, 2i + 1)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def gguf_tensors(state: dict[str, torch.Tensor], config: dict, arch: str
                 ) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array (row-major, as the HF weight), experts stacked."""
    model_type = config["model_type"]
    if arch == "deepseek2":
        return deepseek2_tensors(state, config)
    out, experts = {}, {}
    for hf, tensor in state.items():
        w = tensor.float().numpy()
        name, expert = gguf_name(hf, arch, model_type)
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in hf else \
                config["num_key_value_heads"]
            w = permute_rotary(w, heads)
        if model_type == "gemma3_text" and hf.endswith("norm.weight"):
            w = w + _GEMMA_NORM_OFFSET
        if hf.endswith("shared_expert_gate.weight"):
            w = w.reshape(-1)
        if expert is None:
            out[name] = w
        else:
            experts.setdefault(name, {})[expert] = w
    for name, per_expert in experts.items():
        out[name] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs.weight for a "llama3" rope: per rotary
    pair, 1 where the wavelength is short (< original / high_freq_factor), `factor` where it
    is long (> original / low_freq_factor), and between them the inverse of the linear blend
    `(1 - s) / factor + s`, s = (original / wavelength - low) / (high - low)."""
    rope = config["rope_parameters"]
    heads = config["num_attention_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // heads
    original, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factors = []
    for wavelength in 2 * np.pi / inv_freq:
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            s = (original / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - s) / factor + s))
    return np.array(factors, dtype=np.float32)


def metadata(config: dict, arch: str, shapes: dict[str, tuple]) -> dict[str, object]:
    """The llama.cpp metadata keys of a config (without the `{arch}.` prefix)."""
    if arch == "deepseek2":
        return deepseek2_metadata(config, split_kv_b="blk.0.attn_k_b.weight" in shapes)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    meta = {"context_length": config["max_position_embeddings"],
            "embedding_length": config["hidden_size"], "block_count": config["num_hidden_layers"],
            "feed_forward_length": config.get("intermediate_size", 0),
            "attention.head_count": heads,
            "attention.head_count_kv": config["num_key_value_heads"],
            "attention.key_length": head_dim, "attention.value_length": head_dim,
            "attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
            "rope.freq_base": _rope_theta(config), "vocab_size": config["vocab_size"]}
    if config["model_type"] == "gemma3_text":  # which layers slide: one flag per layer
        meta["attention.sliding_window"] = config["sliding_window"]
        meta["attention.sliding_window_pattern"] = [t == "sliding_attention"
                                                    for t in config["layer_types"]]
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    if num_experts:
        meta |= {"expert_count": num_experts, "expert_used_count": config["num_experts_per_tok"]}
    if config.get("moe_intermediate_size"):
        meta["expert_feed_forward_length"] = config["moe_intermediate_size"]
    if config.get("shared_expert_intermediate_size"):
        meta["expert_shared_feed_forward_length"] = config["shared_expert_intermediate_size"]
    return meta


_DEEPSEEK2_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def deepseek2_tensors(state: dict[str, torch.Tensor], config: dict, split_kv_b: bool = False
                      ) -> dict[str, np.ndarray]:
    """A DeepSeek V3 checkpoint as llama.cpp's deepseek2 converter writes it: no row
    permutation, experts stacked, the router bias as exp_probs_b.bias, and (newer files,
    `split_kv_b`) kv_b_proj split per head into attn_k_b (transposed) and attn_v_b."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    out, experts = {}, {}
    for hf, tensor in state.items():
        w = tensor.float().numpy()
        if hf in top:
            out[top[hf]] = w
            continue
        layer, rest = hf.split(".")[2], ".".join(hf.split(".")[3:])
        module, suffix = rest.rsplit(".", 1)
        if suffix == "e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = w
        elif ".experts." in module:
            expert, proj = module.split(".experts.")[1].split(".")
            name = f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.{suffix}"
            experts.setdefault(name, {})[int(expert)] = w
        elif module == "self_attn.kv_b_proj" and split_kv_b:
            kv_b = w.reshape(heads, -1, w.shape[-1])  # [heads, nope + v, rank]
            out[f"blk.{layer}.attn_k_b.{suffix}"] = np.ascontiguousarray(
                kv_b[:, :nope].transpose(0, 2, 1))
            out[f"blk.{layer}.attn_v_b.{suffix}"] = np.ascontiguousarray(kv_b[:, nope:])
        else:
            out[f"blk.{layer}.{_DEEPSEEK2_NAMES[module]}.{suffix}"] = w
    for name, per_expert in experts.items():
        out[name] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def deepseek2_metadata(config: dict, split_kv_b: bool = False) -> dict[str, object]:
    """llama.cpp's deepseek2 keys: older files give the per-head key / value sizes, newer
    ones (with attn_k_b / attn_v_b) the absorbed MQA form plus key_length_mla and
    value_length_mla."""
    heads, rank, rope = (config["num_attention_heads"], config["kv_lora_rank"],
                         config["qk_rope_head_dim"])
    qk, v = config["qk_nope_head_dim"] + rope, config["v_head_dim"]
    meta = {"context_length": config["max_position_embeddings"],
            "embedding_length": config["hidden_size"], "block_count": config["num_hidden_layers"],
            "feed_forward_length": config["intermediate_size"], "attention.head_count": heads,
            "attention.head_count_kv": 1 if split_kv_b else config["num_key_value_heads"],
            "attention.key_length": rank + rope if split_kv_b else qk,
            "attention.value_length": rank if split_kv_b else v,
            "attention.kv_lora_rank": rank, "rope.dimension_count": rope,
            "attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
            "rope.freq_base": _rope_theta(config), "vocab_size": config["vocab_size"],
            "leading_dense_block_count": config["first_k_dense_replace"],
            "expert_feed_forward_length": config["moe_intermediate_size"],
            "expert_count": config["n_routed_experts"],
            "expert_used_count": config["num_experts_per_tok"],
            "expert_shared_count": config["n_shared_experts"],
            "expert_weights_scale": float(config["routed_scaling_factor"]),
            "expert_group_count": config["n_group"], "expert_group_used_count": config["topk_group"],
            "expert_gating_func": 2}
    if split_kv_b:
        meta |= {"attention.key_length_mla": qk, "attention.value_length_mla": v}
    if config.get("q_lora_rank"):
        meta["attention.q_lora_rank"] = config["q_lora_rank"]
    if config.get("norm_topk_prob"):  # the converter writes it only when true
        meta["expert_weights_norm"] = True
    rope_params = config.get("rope_parameters") or {}
    if rope_params.get("rope_type") == "yarn":
        meta |= {"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope_params["factor"]),
                 "rope.scaling.original_context_length":
                     rope_params["original_max_position_embeddings"],
                 "rope.scaling.yarn_log_multiplier": 0.1 * rope_params["mscale_all_dim"]}
    return meta


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    return float(config.get("rope_theta") or params.get("rope_theta", 10000.0))


def write_gguf(path: Path, arch: str, meta: dict, tensors: dict[str, np.ndarray],
               qtype: str = "F32", tokenizer_from: str | None = None) -> None:
    """Write a GGUF file: 2-D weights whose rows allow it in `qtype`, the rest F32."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(path.stem)
    for key, value in meta.items():
        _add(writer, f"{arch}.{key}", value)
    if tokenizer_from is not None:
        copy_tokenizer(writer, tokenizer_from)
    for name, w in tensors.items():
        data, kind = _encode(w, qtype)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _encode(w: np.ndarray, qtype: str):
    """(data, raw_dtype) of a weight in GGUF type `qtype` (F32 where it cannot be)."""
    import gguf
    from gguf.quants import quantize

    kind = gguf.GGMLQuantizationType[qtype]
    if w.ndim < 2 or qtype == "F32" or w.shape[-1] % 32:
        return np.ascontiguousarray(w, dtype=np.float32), None
    if qtype == "F16":
        return np.ascontiguousarray(w, dtype=np.float16), None
    return quantize(np.ascontiguousarray(w, dtype=np.float32), kind), kind


def _add(writer, key: str, value) -> None:
    if isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, str(value))


def copy_tokenizer(writer, source: str) -> None:
    """Every tokenizer.* field of the GGUF file `source`, as it is there (value types kept)."""
    for key, (value, types) in _tokenizer_fields(source).items():
        writer.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(source: str) -> dict:
    from duplex.engine.models.gguf_reader import read_gguf

    file = read_gguf(source)
    return {k: (v, file.types[k]) for k, v in file.fields.items() if k.startswith("tokenizer.")}


def dequantized_state(state: dict[str, torch.Tensor], config: dict, arch: str, qtype: str
                      ) -> dict[str, torch.Tensor]:
    """The HF state dict with each weight as the GGUF file holds it after `qtype` rounding
    (what a reference model must load to run the same weights)."""
    from gguf.quants import dequantize

    out = {}
    for hf, tensor in state.items():
        w = tensor.float().numpy()
        data, kind = _encode(w, qtype)
        if kind is not None:
            w = dequantize(data, kind).reshape(w.shape)
        elif data.dtype == np.float16:
            w = data.astype(np.float32)
        out[hf] = torch.from_numpy(np.array(w, dtype=np.float32))
    return out


@torch.inference_mode()
def duplex_logits(path: str, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Duplex's fp32 logits [len(ids), vocab] for one prompt, one prefill step of the model
    loaded from `path` (no engine: the model's forward over a fresh paged cache)."""
    from duplex.engine.models import ForwardContext, build_model
    from duplex.engine.models.loader import load

    args, state, _, _ = load(path, torch.float32, progress=False)
    model = build_model(args, state)
    n, blocks = len(ids), -(-len(ids) // block_size)
    kv = torch.zeros(args.num_layers, 2, blocks, block_size, args.num_kv_heads, args.head_dim)
    ctx = ForwardContext(
        positions=torch.arange(n), slot_mapping=torch.arange(n),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        kv_caches=[(kv[i, 0], kv[i, 1]) for i in range(args.num_layers)],
        query_lens=[n], host_seq_lens=[n], block_size=block_size, slots_valid=True)
    return model.compute_logits(model.forward(torch.tensor(ids), ctx))


@torch.inference_mode()
def hf_logits(hf_dir, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [len(ids), vocab] for one prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return model(torch.tensor([ids])).logits[0].float()


class TinyModel:
    """A tiny model's HF directory, config and checkpoint weights, and GGUF writers."""

    def __init__(self, name: str, root: Path) -> None:
        from safetensors.torch import load_file

        self.name, self.root = name, root
        self.arch = TINY[name][1]
        self.hf_dir = build_hf(name, root)
        self.config = json.loads((self.hf_dir / "config.json").read_text())
        self.state = {}
        for f in sorted(self.hf_dir.glob("*.safetensors")):
            self.state.update(load_file(str(f)))

    def gguf(self, qtype: str = "F32", tokenizer_from: str | None = None,
             tensors: dict | None = None, meta: dict | None = None, tag: str = "") -> str:
        tensors = tensors if tensors is not None else gguf_tensors(self.state, self.config,
                                                                    self.arch)
        meta = meta if meta is not None else metadata(
            self.config, self.arch, {k: v.shape for k, v in tensors.items()})
        path = self.root / f"{self.name}-{qtype}{tag}.gguf"
        write_gguf(path, self.arch, meta, tensors, qtype, tokenizer_from)
        return str(path)

    def reference_dir(self, qtype: str) -> Path:
        """An HF directory with the weights rounded as a `qtype` GGUF holds them."""
        from safetensors.torch import save_file

        if qtype == "F32":
            return self.hf_dir
        path = self.root / f"{self.name}-hf-{qtype}"
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config))
        save_file(dequantized_state(self.state, self.config, self.arch, qtype),
                  str(path / "model.safetensors"))
        return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """name -> TinyModel, built on first use."""
    built = {}

    def get(name: str) -> TinyModel:
        if name not in built:
            built[name] = TinyModel(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


# ---------------------------------------------------------------------------- files that cannot run
# kind -> the reason Duplex must give for it (after "<path>: ")
BAD_FILES = {
    "unknown_arch": "unsupported GGUF architecture 'mamba'; supported: llama, mistral, qwen2, "
                    "qwen3, gemma3, qwen2moe, qwen3moe, deepseek2",
    "no_quant_path": "tensor blk.0.attn_q.weight has quantization type Q8_1, which Duplex "
                     "cannot read",
    # {size}: the truncated file's length (the last 4096 bytes of the complete file are cut)
    "truncated": "not a readable GGUF file (it ends at byte {size}, inside the data of tensor "
                 "blk.2.attn_v.weight)",
    "bad_magic": "not a readable GGUF file (the magic is b'GGUX', not b'GGUF')",
    "bad_shape": "tensor blk.0.attn_q.weight has shape [32, 64], the metadata implies [64, 64]",
    "missing_tensor": "tensor blk.1.attn_k.weight is missing (the metadata implies it)",
}
_Q8_1_BYTES_PER_32 = 40  # a Q8_1 block: 32 int8 values, fp16 scale and sum


def write_bad_file(model: TinyModel, kind: str) -> str:
    """A GGUF file of the tiny llama model (with the default model's tokenizer, so only the
    weights are wrong) broken the way `kind` says."""
    from duplex.engine.config import default_model_path

    tokenizer = default_model_path()
    tensors = gguf_tensors(model.state, model.config, model.arch)
    meta = metadata(model.config, model.arch, {})
    path = model.root / f"{kind}.gguf"
    if kind in ("truncated", "bad_magic"):
        data = Path(model.gguf("F32", tokenizer_from=tokenizer, tag="-tok")).read_bytes()
        path.write_bytes(data[:-4096] if kind == "truncated" else b"GGUX" + data[4:])
    elif kind == "unknown_arch":
        write_gguf(path, "mamba", meta, tensors, tokenizer_from=tokenizer)
    elif kind == "missing_tensor":
        del tensors["blk.1.attn_k.weight"]
        write_gguf(path, "llama", meta, tensors, tokenizer_from=tokenizer)
    elif kind == "bad_shape":
        q = tensors["blk.0.attn_q.weight"]
        write_gguf(path, "llama", meta, {**tensors, "blk.0.attn_q.weight": q[:q.shape[0] // 2]},
                   tokenizer_from=tokenizer)
    else:
        _write_q8_1(path, meta, tensors, tokenizer)
    return str(path)


def _write_q8_1(path: Path, meta: dict, tensors: dict[str, np.ndarray], tokenizer: str) -> None:
    """blk.0.attn_q.weight in Q8_1, a type `gguf` cannot dequantize (bytes all zero)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        _add(writer, f"llama.{key}", value)
    copy_tokenizer(writer, tokenizer)
    for name, w in tensors.items():
        if name == "blk.0.attn_q.weight":
            raw = np.zeros((w.shape[0], w.shape[1] // 32 * _Q8_1_BYTES_PER_32), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def bad_file(tiny_model):
    """kind (a BAD_FILES key) -> path of that broken GGUF file, written on first use."""
    written = {}

    def get(kind: str) -> str:
        if kind not in written:
            written[kind] = write_bad_file(tiny_model("llama"), kind)
        return written[kind]

    return get
