"""OutputStream: for every split of the token ids, the text equals decoding them all at once and
cutting at the first stop string to complete; the finish reason and stop string agree."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.engine.messages import FinishReason
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.text.output import OutputStream

TEXT = "Hello there — 你好 🙂 friend! The answer is 42.</answer> and then more text"


def reference(text, stops, include):
    """(text, stop string) as a whole-text cut: the stop string that ends first (ties: the one
    starting first) ends the text."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, start, stop_str = min(hits)
    return text[:end if include else start], stop_str


def run(stream, ids, sizes, engine_finish=FinishReason.LENGTH):
    """Push `ids` in chunks of `sizes`, the rest with the engine's finish; stop at a stop
    string as the callers do. Returns (deltas, finish reason)."""
    deltas, pos = [], 0
    for size in sizes:
        deltas.append(stream.push(ids[pos:pos + size]))
        pos += size
        if stream.is_stopped:
            return deltas, stream.finish_reason(None)
    deltas.append(stream.push(ids[pos:], is_last=True))
    return deltas, stream.finish_reason(engine_finish)


@pytest.fixture(scope="module")
def ids(default_tokenizer):
    return default_tokenizer.encode(TEXT, add_special_tokens=False)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), max_size=40),
       stops=st.sampled_from([[], ["</answer>"], ["zzz"], ["friend", "end!"], ["🙂"],
                              ["42.</", "answer"], ["你好"], ["text!"]]),
       include=st.booleans())
def test_any_split_matches_the_whole_text_cut(default_recipe, ids, sizes, stops, include):
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    stream = OutputStream.for_params(default_recipe, params)
    deltas, finish_reason = run(stream, ids, sizes)
    expected_text, expected_stop = reference(TEXT, stops, include)
    assert "".join(deltas) == expected_text == stream.text
    assert stream.stop_str == expected_stop
    assert finish_reason == (FinishReason.STOP if expected_stop else FinishReason.LENGTH)
    assert not any("\ufffd" in delta for delta in deltas)


def test_partial_stop_string_is_held_until_it_turns_out_not_to_be_one(default_recipe):
    tokenizer = default_recipe.tokenizer
    stream = OutputStream(default_recipe.new_detokenizer(), ["</answer>"])
    first = tokenizer.encode("42</ans", add_special_tokens=False)
    assert stream.push(first) == "42"            # "</ans" might still become the stop string
    rest = tokenizer.encode("wers", add_special_tokens=False)
    assert stream.push(rest, is_last=True) == "</answers"
    assert not stream.is_stopped and stream.finish_reason(FinishReason.STOP) == "stop"


def test_the_last_push_releases_a_tail_that_never_became_a_stop_string(default_recipe):
    tokenizer = default_recipe.tokenizer
    stream = OutputStream(default_recipe.new_detokenizer(), ["text!"])
    assert stream.push(tokenizer.encode("more text", add_special_tokens=False)) == "more "
    assert stream.push([], is_last=True) == "text" and stream.text == "more text"


def test_the_last_push_releases_a_broken_character(default_recipe):
    tokenizer = default_recipe.tokenizer
    all_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    cut = next(k for k in range(1, len(all_ids))
               if tokenizer.decode(all_ids[:k]).endswith("\ufffd"))
    ids = all_ids[:cut]   # a multi-byte character cut short
    whole = tokenizer.decode(ids)
    stream = OutputStream(default_recipe.new_detokenizer(), ["zzz"])
    held = stream.push(ids)
    assert held + stream.push([], is_last=True) == whole and "\ufffd" not in held


def test_a_failed_stream_keeps_its_tail_unless_released(default_recipe):
    tokenizer = default_recipe.tokenizer
    stream = OutputStream(default_recipe.new_detokenizer(), ["STOP"])
    assert stream.push(tokenizer.encode("Hi ST", add_special_tokens=False)) == "Hi "
    assert stream.push([]) == "" and stream.text == "Hi "
    assert stream.finish_reason(FinishReason.ABORT) == FinishReason.ABORT


def test_without_a_tokenizer_there_is_no_text():
    stream = OutputStream.for_params(None, SamplingParams(stop=["x"]))
    assert stream.push([1, 2, 3], is_last=True) == "" and stream.text == ""
    assert not stream.is_stopped and stream.stop_str is None


def test_finish_reason_values_are_the_wire_strings():
    assert [r.value for r in FinishReason] == ["stop", "length", "tool_calls", "abort", "error",
                                               "timeout"]
    assert FinishReason.STOP == "stop" and f"{FinishReason.LENGTH}" == "length"
