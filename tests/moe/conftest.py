"""MoE test fixtures: tiny randomly initialised MoE checkpoints, built from transformers
configs and saved as safetensors once per session."""
from __future__ import annotations

import pytest
import torch

VOCAB = 384

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               initializer_range=0.3, tie_word_embeddings=False)

# model_type -> extra config fields; spread init (0.3) keeps top-k choices and argmax far
# from ties, so fp rounding differences never flip a token.
TINY_CONFIGS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(head_dim=32, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=64, norm_topk_prob=False),
    "deepseek_v3": dict(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_group=4,
                        topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
                        moe_intermediate_size=48, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, num_key_value_heads=4),  # MLA: kv heads = heads
}
TINY_CONFIGS["deepseek_v3_yarn"] = dict(
    TINY_CONFIGS["deepseek_v3"], q_lora_rank=None,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                         original_max_position_embeddings=64, mscale=0.707,
                         mscale_all_dim=1.0, beta_fast=32, beta_slow=1))


def build_tiny_moe(path, name: str) -> str:
    """Save a tiny random model of family `name` (a TINY_CONFIGS key) under `path`."""
    import transformers

    arch = name.removesuffix("_yarn")
    config_cls, model_cls = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**_COMMON, **TINY_CONFIGS[name]})).eval()
    with torch.no_grad():
        for name_, buffer in model.named_buffers():
            if name_.endswith("e_score_correction_bias"):  # zeros after init: make it count
                buffer.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """name -> path of the saved tiny model, built on first use."""
    built = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = build_tiny_moe(tmp_path_factory.mktemp(name), name)
        return built[name]

    return get


def add_word_tokenizer(path) -> str:
    """Give a tiny model directory a tokenizer `duplex serve` can use: token i is the word
    "w<i>" (0 is <eos>, 1 a control token), with a one-line chat template. The unknown word
    "w2" is the model's own, not an added special token: a completion prompt parses special
    tokens, and an added "w2" would match inside "w227"."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(2, VOCAB)} | {"<eos>": 0, "<|user|>": 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    tokenizer.add_special_tokens(["<eos>", "<|user|>"])
    tokenizer.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>",
        "chat_template": "{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"}))
    return str(path)
