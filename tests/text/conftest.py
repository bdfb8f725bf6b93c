"""Fixtures for the recipe tests: the default GGUF tokenizer and a Hermes/Qwen-style tools
tokenizer built locally from its vocabulary (no hub)."""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from duplex.engine.config import default_model_path  # noqa: E402
from duplex.engine.text.recipe import Recipe  # noqa: E402
from recipe_factories import TOOLS_TEMPLATE  # noqa: E402
from reasoning_models import qwen3_tokenizer_dir, r1_tokenizer_dir  # noqa: E402


@pytest.fixture(scope="session")
def default_recipe() -> Recipe:
    return Recipe.from_model(default_model_path())


@pytest.fixture(scope="session")
def default_tokenizer(default_recipe):
    return default_recipe.tokenizer


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory, default_tokenizer):
    """A local Hugging Face tokenizer directory: the default vocabulary plus Qwen's non-special
    `<tool_call>`/`</tool_call>` tokens, with a Hermes-style chat template."""
    directory = tmp_path_factory.mktemp("tools_model")
    spec = json.loads(default_tokenizer.backend_tokenizer.to_str())
    next_id = max(token["id"] for token in spec["added_tokens"]) + 1
    next_id = max(next_id, len(spec["model"]["vocab"]))
    for offset, content in enumerate(("<tool_call>", "</tool_call>")):
        spec["added_tokens"].append({"id": next_id + offset, "content": content,
                                     "single_word": False, "lstrip": False, "rstrip": False,
                                     "normalized": False, "special": False})
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TOOLS_TEMPLATE,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>"}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return str(directory)


@pytest.fixture(scope="session")
def tools_recipe(tools_model_dir) -> Recipe:
    return Recipe.from_model(tools_model_dir)


@pytest.fixture(scope="session")
def tools_tokenizer(tools_recipe):
    return tools_recipe.tokenizer



# ---------------------------------------------------------------- reasoning models (no hub)
@pytest.fixture(scope="session")
def r1_recipe(tmp_path_factory, default_tokenizer) -> Recipe:
    """DeepSeek-R1-Distill-Qwen's template; `<think>` plain added tokens, as in its tokenizer."""
    return Recipe.from_model(r1_tokenizer_dir(tmp_path_factory.mktemp("r1"), default_tokenizer))


@pytest.fixture(scope="session")
def qwen3_recipe(tmp_path_factory, default_tokenizer) -> Recipe:
    return Recipe.from_model(qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3"),
                                                 default_tokenizer))


@pytest.fixture(scope="session")
def qwen3_special_recipe(tmp_path_factory, default_tokenizer) -> Recipe:
    """Qwen3's template with `<think>`/`</think>` as special tokens (dropped by decoding)."""
    return Recipe.from_model(qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3s"),
                                                 default_tokenizer, think_special=True))
