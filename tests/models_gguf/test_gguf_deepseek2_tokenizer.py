"""A deepseek2 GGUF file is a whole model: its tokenizer and chat template come from the file
although transformers' AutoTokenizer refuses the architecture ("GGUF model with
architecture deepseek2 is not supported yet."), and `duplex.LLM` generates from the file
alone (transformers' greedy tokens on the same weights, detokenized by the file's tokenizer)."""
from __future__ import annotations

import pytest

from duplex.engine.config import default_model_path
from duplex.engine.sampling_params import SamplingParams

from tests.models_gguf.test_gguf_archs import NUM_NEW, PROMPTS, reference


@pytest.fixture
def deepseek_with_tokenizer(tiny_model, tmp_path, monkeypatch):
    """The tiny DeepSeek V3 file with the default model's tokenizer, converted afresh (a
    private tokenizer cache: an entry from an earlier run must not stand in for the file).
    The default model's tokenizer, which it is compared with, is loaded first, from the
    usual cache (converting it again in the private one would only repeat a conversion)."""
    from duplex.engine.text.tokenizer import load_tokenizer

    load_tokenizer(default_model_path())
    monkeypatch.setenv("DUPLEX_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model("deepseek_v3")
    return model, model.gguf("F32", tokenizer_from=default_model_path(), tag="-tok")


def test_deepseek2_tokenizer_and_chat_template_come_from_the_file(deepseek_with_tokenizer):
    from duplex.engine.text.tokenizer import load_tokenizer

    _, path = deepseek_with_tokenizer
    ours, default = load_tokenizer(path), load_tokenizer(default_model_path())
    text = "Hello, GGUF world! <|im_start|>user\nhi"
    assert ours.encode(text) == default.encode(text)
    assert ours.decode(default.encode(text)) == text
    assert ours.chat_template == default.chat_template is not None
    assert (ours.eos_token, ours.bos_token) == (default.eos_token, default.bos_token)


def test_llm_generates_from_a_deepseek2_file_alone(deepseek_with_tokenizer):
    from duplex import LLM

    model, path = deepseek_with_tokenizer
    llm = LLM(path, progress=False, weights_dtype="float32", num_kv_blocks=16)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == reference(str(model.hf_dir))
    tokenizer = llm.recipe.tokenizer
    for out in outputs:
        assert out.text == tokenizer.decode(out.token_ids) and out.text
