"""Structured-output fixtures: engines on the default model, and a tiny random model with a
tiny byte-level tokenizer trained here (its text is noise: only a grammar makes it valid)."""
from __future__ import annotations

import pytest
import torch

from duplex.engine import core as core_module
from duplex.engine.config import EngineConfig
from duplex.engine.core import EngineCore
# one cache with the engine tests', so a whole-suite run loads the default model once
from tests.engine.conftest import _cached_load


@pytest.fixture(autouse=True)
def _reuse_loaded_weights(monkeypatch):
    """Weights are read-only in the engine, so tests share one load per model file."""
    monkeypatch.setattr(core_module, "load", _cached_load)


def make_core(model: str | None, **kwargs) -> EngineCore:
    core_module.load = _cached_load  # module fixtures run before the autouse patch
    return EngineCore(EngineConfig.of(model=model, **kwargs), progress=False)


CORPUS = ['{"name": "cat", "kind": "dog", "tags": ["a", "b"], "home": {"ok": true}}',
          "Describe an animal. A year and a code: 1999-ab. Pick a color: red, green, blue.",
          "hello world, tools and calls: get_weather(city) <tool_call> </tool_call>"]


def tiny_tokenizer():
    """A byte-level BPE tokenizer of ~340 tokens trained here (no hub), ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                  bos_token="<|im_start|>")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random Llama over a tiny byte-level vocabulary (padded to 384 rows)."""
    import transformers

    tokenizer = tiny_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True, initializer_range=0.5)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny_structured")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)
