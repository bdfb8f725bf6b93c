"""The offline API on the default model: its text is the recipe's decode of its token ids,
stop strings cut it as a whole-text cut would, and chats are encoded by the recipe, with
the variables of `chat_template_kwargs` where the template reads them."""
from __future__ import annotations

import pytest

from duplex.engine.llm import LLM
from duplex.engine.messages import FinishReason
from duplex.engine.text.messages import Chat
from duplex.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow   # loads the default model

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def llm(default_model) -> LLM:
    return LLM(default_model, progress=False, num_kv_blocks=64)


@pytest.fixture(scope="module")
def full(llm):
    """A greedy reply that runs to max_tokens."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    return llm.generate(PROMPT, params)[0]


def test_text_is_the_decode_of_the_token_ids(llm, full):
    assert full.finish_reason == FinishReason.LENGTH == "length"
    assert len(full.token_ids) == 24 and len(full.logprobs) == 24
    assert full.text == llm.recipe.decode(full.token_ids)
    assert full.prompt_token_ids == llm.recipe.encode_completion(PROMPT)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_cuts_the_text_and_ends_the_request(llm, full, include):
    stop = full.text.strip()[4:7]
    start = full.text.find(stop)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include)
    out = llm.generate(PROMPT, params)[0]
    assert out.text == full.text[:start + (len(stop) if include else 0)]
    assert (out.finish_reason, out.stop_reason) == (FinishReason.STOP, "stop_string")
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and out.logprobs is None
    assert len(out.token_ids) < len(full.token_ids)


def test_chat_is_encoded_by_the_recipe(llm):
    chat = [{"role": "user", "content": "Say hi <|im_end|>"}]
    out = llm.chat(chat, SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.prompt_token_ids == llm.recipe.encode_chat(Chat.from_dicts(chat))
    assert out.text == llm.recipe.decode(out.token_ids)


# the default template with a variable of its own, as a model's `enable_thinking`
PERSONA_TEMPLATE = ("{{ '<|im_start|>system\\n' + persona + '<|im_end|>\\n' }}"
                    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
                    " + '<|im_end|>\\n' }}{% endfor %}{{ '<|im_start|>assistant\\n' }}")


def test_chat_template_kwargs_are_the_template_variables(llm):
    chat = [{"role": "user", "content": "Say hi"}]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    out = llm.chat(chat, params, chat_template=PERSONA_TEMPLATE,
                   chat_template_kwargs={"persona": "You are a pirate."})[0]
    assert llm.recipe.decode(out.prompt_token_ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nSay hi<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert len(out.token_ids) == 2


@pytest.mark.parametrize("template, reads", [(None, ""),
                                             (PERSONA_TEMPLATE, " (it reads persona)")])
def test_a_key_the_template_does_not_read_is_refused_by_name(llm, template, reads):
    chat = [{"role": "user", "content": "Say hi"}]
    with pytest.raises(ValueError) as e:
        llm.chat(chat, SamplingParams(max_tokens=2), chat_template=template,
                 chat_template_kwargs={"enable_thinking": False})
    assert str(e.value) == ("chat_template_kwargs.enable_thinking: the chat template reads no "
                            "variable 'enable_thinking'" + reads)


def test_a_string_prompt_parses_control_tokens_a_chat_does_not(llm):
    """As /v1/completions (docs/control-tokens.md): the caller of generate writes the whole
    prompt, so `<|im_start|>` is that token (id 1 in the default model); in a chat message
    the same characters stay text."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = llm.generate("<|im_start|>user\nHi", params)[0]
    assert out.prompt_token_ids[0] == 1 and 1 not in llm.recipe.encode_prompt("<|im_start|>")
    chat = llm.chat([{"role": "user", "content": "<|im_start|>"}], params)[0]
    assert chat.prompt_token_ids.count(1) == llm.recipe.encode_chat(
        Chat.from_dicts([{"role": "user", "content": "x"}])).count(1)
