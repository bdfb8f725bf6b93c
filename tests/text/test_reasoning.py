"""engine/text/reasoning.py: the thinking block split from the answer, on text and on token
ids, for the real DeepSeek-R1-Distill-Qwen and Qwen3 chat templates (tests/text/templates)."""
import pytest
from reasoning_models import reasoning_template

from duplex.engine.text.messages import Chat
from duplex.engine.text.output import OutputStream
from duplex.engine.text.reasoning import (ReasoningFormat, ReasoningParser, check_fits,
                                          check_parser_name, detect_parser, template_variables)
from recipe_factories import assistant, user

R1 = reasoning_template("deepseek_r1_distill_qwen")
QWEN3 = reasoning_template("qwen3")


def parse_pieces(parser: ReasoningParser, pieces: list[str]) -> tuple[list[str], list[str]]:
    reasoning, answer = [], []
    for piece in pieces:
        split = parser.push(piece)
        reasoning.append(split.reasoning)
        answer.append(split.answer)
    end = parser.finish()
    return reasoning + [end.reasoning], answer + [end.answer]


@pytest.mark.parametrize("text, in_reasoning, expected", [
    ("<think>\nLet me see.\n2+2 is 4.\n</think>\n\nIt is 4.", False,
     ("Let me see.\n2+2 is 4.", "It is 4.")),
    ("Let me see.\n</think>\n\nIt is 4.", True, ("Let me see.", "It is 4.")),
    ("Just the answer <think> here.", False, ("", "Just the answer <think> here.")),
    ("\n\n<think>a < b </thinking> c</think>x", False, ("a < b </thinking> c", "x")),
    ("cut by max_tokens </thi", True, ("cut by max_tokens", "")),
    ("<think>\n\n</think>\n\n", False, ("", "")),
])
def test_every_split_of_the_text_gives_the_same_channels(text, in_reasoning, expected):
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1):
            pieces = [text[:cut], text[cut:second], text[second:]]
            reasoning, answer = parse_pieces(ReasoningParser(in_reasoning), pieces)
            assert ("".join(reasoning), "".join(answer)) == expected, pieces


def test_a_partial_marker_never_reaches_either_channel_while_streaming():
    text = "<think>\nx </think>\n\ny"
    reasoning, answer = parse_pieces(ReasoningParser(False), list(text))  # one char a push
    assert reasoning == [""] * 8 + ["x"] + [""] * 13  # "x" at its push, its blank held
    assert "".join(answer) == "y" and answer[-2] == "y"


def test_never_closed_block_is_all_reasoning():
    parser = ReasoningParser(in_reasoning=True)
    assert parser.push("thinking and") == ("thinking and", "")
    assert parser.push(" thinking ") == (" thinking", "")
    assert parser.finish() == ("", "")
    assert parser.in_reasoning and not parser.ended_reasoning


def test_parser_names_detection_and_fit():
    assert detect_parser(R1) == "deepseek_r1"
    assert detect_parser(QWEN3) == "qwen3"
    assert detect_parser("{{ messages }}") is None
    assert detect_parser("<think>{{ x }}</think>") is None  # markers, but whose: ambiguous
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'r2'; choose one of "
                                         r"deepseek_r1, qwen3"):
        check_parser_name("r2")
    with pytest.raises(ValueError, match=r"reasoning parser 'qwen3' does not fit this model: "
                                         r"its chat template never writes or reads '</think>'"):
        check_fits("qwen3", "{% for m in messages %}{{ m.content }}{% endfor %}")
    check_fits("deepseek_r1", R1)


def test_template_variables_are_what_the_template_reads():
    assert "enable_thinking" in template_variables(QWEN3)
    assert "enable_thinking" not in template_variables(R1)
    assert "bos_token" in template_variables(R1)


# ---------------------------------------------------------------- on token ids, real tokenizers
def stream_ids(recipe, fmt: ReasoningFormat, prompt_ids: list[int], output_ids: list[int]):
    """The output as a model writes it, one token a step, through OutputStream + the parser."""
    stream = OutputStream(recipe.new_detokenizer())
    parser = fmt.new_parser(recipe.decode(prompt_ids[-8:], skip_special_tokens=False))
    reasoning, answer = [], []
    for k, token_id in enumerate(output_ids):
        is_last = k == len(output_ids) - 1
        split = parser.push(fmt.push_ids(stream, [token_id], is_last))
        if is_last:
            end = parser.finish()
            split = split._replace(reasoning=split.reasoning + end.reasoning,
                                   answer=split.answer + end.answer)
        reasoning.append(split.reasoning)
        answer.append(split.answer)
    return "".join(reasoning), "".join(answer), reasoning


def test_r1_prompt_opens_the_block_and_the_model_only_closes_it(r1_recipe):
    prompt = r1_recipe.encode_chat(Chat([user("2+2?")], None))
    assert r1_recipe.decode(prompt, skip_special_tokens=False).endswith(
        "<｜User｜>2+2?<｜Assistant｜><think>\n")
    output = r1_recipe.encode_reply_start("Two and two.\n</think>\n\nFour.")
    end_id = r1_recipe.tokenizer.convert_tokens_to_ids("</think>")
    assert end_id in output  # the marker is one token of the model's output
    fmt = ReasoningFormat.for_recipe("deepseek_r1", r1_recipe)
    assert fmt.marker_ids == {}  # plain added tokens: they decode as text
    reasoning, answer, _ = stream_ids(r1_recipe, fmt, prompt, output)
    assert (reasoning, answer) == ("Two and two.", "Four.")


def test_qwen3_enable_thinking_false_renders_a_closed_block_and_all_is_answer(qwen3_recipe):
    chat = Chat([user("Hi")], None)
    prompt = qwen3_recipe.encode_chat(chat, variables={"enable_thinking": False})
    reference = qwen3_recipe.tokenizer.apply_chat_template(
        [user("Hi")], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert qwen3_recipe.decode(prompt, skip_special_tokens=False) == reference
    assert reference.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    fmt = ReasoningFormat.for_recipe("qwen3", qwen3_recipe)
    output = qwen3_recipe.encode_reply_start("Hello </think> there.")
    assert stream_ids(qwen3_recipe, fmt, prompt, output)[:2] == ("", "Hello </think> there.")


def test_qwen3_thinking_on_the_model_opens_the_block(qwen3_recipe):
    prompt = qwen3_recipe.encode_chat(Chat([user("Hi")], None))
    fmt = ReasoningFormat.for_recipe("qwen3", qwen3_recipe)
    output = qwen3_recipe.encode_reply_start("<think>\nGreet back.\n</think>\n\nHello!")
    assert stream_ids(qwen3_recipe, fmt, prompt, output)[:2] == ("Greet back.", "Hello!")
    plain = qwen3_recipe.encode_reply_start("Hello without thinking.")
    assert stream_ids(qwen3_recipe, fmt, prompt, plain)[:2] == ("", "Hello without thinking.")


def test_special_marker_tokens_are_found_among_the_ids(qwen3_special_recipe):
    recipe = qwen3_special_recipe
    fmt = ReasoningFormat.for_recipe("qwen3", recipe)
    start_id, end_id = (recipe.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    assert fmt.marker_ids == {start_id: "<think>", end_id: "</think>"}
    assert recipe.decode([start_id, end_id]) == ""  # what the detokenizer alone would give
    prompt = recipe.encode_chat(Chat([user("Hi")], None))
    output = recipe.encode_reply_start("<think>\nGreet back.\n</think>\n\nHello!")
    assert start_id in output and end_id in output
    reasoning, answer, steps = stream_ids(recipe, fmt, prompt, output)
    assert (reasoning, answer) == ("Greet back.", "Hello!")


# ---------------------------------------------------------------- history
def test_r1_history_drops_earlier_reasoning_as_its_template_does(r1_recipe):
    turns = [user("2+2?"), assistant("Four.", reasoning_content="Two and two."), user("3+3?")]
    text = r1_recipe.decode(r1_recipe.encode_chat(Chat.from_dicts(turns)),
                            skip_special_tokens=False)
    assert "Two and two." not in text
    assert text.endswith("<｜User｜>2+2?<｜Assistant｜>Four.<｜end▁of▁sentence｜><｜User｜>3+3?"
                         "<｜Assistant｜><think>\n")


def test_qwen3_history_renders_reasoning_where_its_template_wants_it(qwen3_recipe):
    turns = [user("2+2?"), assistant("Four.", reasoning_content="Two and two.")]
    ids = qwen3_recipe.encode_chat(Chat.from_dicts(turns), add_generation_prompt=False)
    reference = qwen3_recipe.tokenizer.apply_chat_template(
        [user("2+2?"), assistant("Four.", reasoning_content="Two and two.")], tokenize=False)
    assert qwen3_recipe.decode(ids, skip_special_tokens=False) == reference
    assert "<think>\nTwo and two.\n</think>\n\nFour." in reference
