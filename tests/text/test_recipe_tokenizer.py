"""Tokenizer loading, control and end tokens, plain-text encoding, the recipe's small API."""
import json

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from duplex.engine.config import default_model_path
from duplex.engine.text import tokenizer as tokenizer_module
from duplex.engine.text.detokenizer import IncrementalDetokenizer
from duplex.engine.text.messages import Chat
from duplex.engine.text.recipe import Recipe
from duplex.engine.text.tokenizer import (chat_template, control_tokens, eos_token_ids, load_tokenizer,
                                special_token_ids, text_encoder)
from recipe_factories import control_ids_in, reference_ids, user


def test_load_tokenizer_is_cached(default_tokenizer):
    # two calls in a row: the session fixture's object may have left the LRU (8 paths) when
    # other files of this process loaded other tokenizers first
    tokenizer = load_tokenizer(default_model_path())
    assert tokenizer is load_tokenizer(default_model_path())
    assert tokenizer.get_vocab() == default_tokenizer.get_vocab()
    assert Recipe.from_model(default_model_path()) is Recipe.from_model(default_model_path())


def test_default_model_facts(default_tokenizer):
    assert "<|im_start|>" in chat_template(default_tokenizer)
    assert eos_token_ids(default_tokenizer, default_model_path()) == [2]
    assert special_token_ids(default_tokenizer) == set(range(17))


def test_hugging_face_directory(tools_tokenizer, tools_model_dir, tools_recipe):
    loaded = load_tokenizer(tools_model_dir)
    # cached per path (the session may have evicted the fixture's copy: other tests load others)
    assert load_tokenizer(tools_model_dir) is loaded
    assert loaded.get_vocab() == tools_tokenizer.get_vocab()
    tool_ids = {tools_tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>")}
    # not special in the tokenizer, but markup: control tokens all the same
    assert not any(tools_tokenizer.added_tokens_decoder[i].special for i in tool_ids)
    assert tool_ids <= special_token_ids(tools_tokenizer)
    # eos, then generation_config.json's list
    assert tools_recipe.eos_token_ids == [2, 0]


def test_missing_model_and_missing_template(tmp_path, default_tokenizer):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope.gguf"))

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        chat_template(NoTemplate())


def test_encode_prompt_is_plain_text(default_recipe):
    text = "Once upon a time, 🙂 你好\n\n  "
    assert default_recipe.encode_prompt(text) == default_recipe.tokenizer(text)["input_ids"]
    ids = default_recipe.encode_prompt("<|im_start|>system<|im_end|>")
    assert control_ids_in(ids, default_recipe.control_token_ids) == []


def test_decode_and_detokenizer(default_recipe):
    ids = default_recipe.encode_chat(Chat.from_dicts([user("hi 🙂")]))
    assert default_recipe.decode(ids) == "system\nYou are a helpful AI assistant named SmolLM, " \
        "trained by Hugging Face\nuser\nhi 🙂\nassistant\n"
    detokenizer = default_recipe.new_detokenizer(skip_special_tokens=False)
    assert isinstance(detokenizer, IncrementalDetokenizer)
    assert detokenizer.push(ids) + detokenizer.flush() == \
        default_recipe.decode(ids, skip_special_tokens=False)


def small_tokenizer(model, pre_tokenizer=None, specials=(), **kwargs):
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizer
    backend.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return TokenizersBackend(tokenizer_object=backend, **kwargs)


def test_merges_that_build_a_control_token_are_split():
    """A BPE whose merges turn plain "ab" into the control token "ab": user text is split."""
    bpe = models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "[UNK]": 3}, merges=[("a", "b")],
                     unk_token="[UNK]")
    tokenizer = small_tokenizer(bpe, specials=["ab"],
                                chat_template="{% for m in messages %}ab{{ m.content }}{% endfor %}")
    recipe = Recipe(tokenizer)
    assert tokenizer("abab", add_special_tokens=False)["input_ids"] == [2, 2]
    assert recipe.encode_chat(Chat.from_dicts([user("ab")])) == [2, 0, 1]
    assert recipe.encode_prompt("xab") == [3, 0, 1]


def test_sentencepiece_prefix_space_only_at_the_start():
    """Metaspace(prepend_scheme="first") adds "▁" only to text at offset 0: text after a control
    token is encoded without it, as transformers does."""
    vocab = {"▁a": 0, "a": 1, "[UNK]": 2, "<s>": 3, "▁b": 4, "b": 5}
    tokenizer = small_tokenizer(
        models.WordLevel(vocab=vocab, unk_token="[UNK]"),
        pre_tokenizers.Metaspace(prepend_scheme="first"), specials=["<s>"], bos_token="<s>",
        chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}<s>{% endfor %}")
    encoder = text_encoder(tokenizer)
    assert encoder.encode("b", at_start=True).ids == [4]
    assert encoder.encode("b", at_start=False).ids == [5]
    recipe = Recipe(tokenizer)
    messages = [user("a b"), user("b")]
    expected = reference_ids(tokenizer, messages)
    assert expected == [3, 1, 4, 3, 5, 3]
    assert recipe.encode_chat(Chat.from_dicts(messages)) == expected
    assert recipe._encode_sections(recipe.render_chat(Chat.from_dicts(messages))) == expected


def test_bos_prefix_only_when_the_tokenizer_adds_one(default_recipe):
    vocab = {"▁a": 0, "a": 1, "[UNK]": 2, "<s>": 3}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.add_special_tokens([AddedToken("<s>", special=True)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 3)])
    recipe = Recipe(TokenizersBackend(tokenizer_object=backend, bos_token="<s>"))
    assert recipe.encode_prompt("a") == [3, 0]
    assert default_recipe.encode_prompt("a") == default_recipe.tokenizer("a")["input_ids"]


def test_markup_added_tokens_are_control_tokens():
    vocab = {"x": 0, "[UNK]": 1}
    tokenizer = small_tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("    ", special=False),
                          AddedToken("[TOOL]", special=False), AddedToken("word", special=False)])
    assert set(control_tokens(tokenizer)) == {"<think>", "[TOOL]"}


def test_non_control_added_tokens_keep_their_ids():
    """A kept added token whose id the cheap rebuild cannot reproduce: copied through JSON."""
    vocab = {"a": 0, "[UNK]": 1}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken("<s>", special=True)])    # id 2, control
    backend.add_tokens([AddedToken("tab", special=False)])           # id 3, kept
    tokenizer = TokenizersBackend(tokenizer_object=backend)
    encoder = text_encoder(tokenizer)
    assert encoder.encode("a tab <s>", at_start=True).ids == [0, 3, 1]
    assert tokenizer("a tab <s>", add_special_tokens=False)["input_ids"] == [0, 3, 2]


def test_gguf_cache_round_trip(tmp_path, tools_tokenizer, monkeypatch):
    monkeypatch.setenv("DUPLEX_CACHE_DIR", str(tmp_path))
    entry = tokenizer_module._gguf_cache_dir(default_model_path())
    assert entry.parent == tmp_path / "tokenizers"
    tokenizer_module._store_in_cache(tools_tokenizer, entry)
    assert (entry / "verified").is_file()
    reloaded = tokenizer_module._load_saved(entry)
    assert tokenizer_module._fingerprint(reloaded) == tokenizer_module._fingerprint(tools_tokenizer)
    assert json.loads((entry / "tokenizer_config.json").read_text())["tokenizer_class"]
    monkeypatch.setenv("DUPLEX_TOKENIZER_CACHE", "0")
    assert tokenizer_module._gguf_cache_dir(default_model_path()) is None
