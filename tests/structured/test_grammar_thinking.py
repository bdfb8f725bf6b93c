"""A constraint after a thinking block (engine/grammar.py, `Constraint.thinking`): inside the
block the grammar allows what it forbids in the answer, after `</think>` the constraint holds;
a thinking-budget continuation (its output ends with the closing text) replays into the
answer; the control-byte ban holds outside the block only. Tokenizers: DeepSeek-R1-Distill's
and Qwen3's real templates over the default vocabulary (tests/text/reasoning_models.py)."""
from __future__ import annotations

import itertools
import json
import types

import pytest
import xgrammar as xgr

from duplex.engine.config import default_model_path
from duplex.engine.grammar import Grammars, thinking_tag
from duplex.engine.sampling_params import Constraint, SamplingParams
from duplex.engine.text.reasoning import CLOSE_TEXT
from duplex.engine.text.recipe import Recipe
from tests.text.reasoning_models import qwen3_tokenizer_dir, r1_tokenizer_dir

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a"], "additionalProperties": False})
REQ_IDS = itertools.count()


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> dict[str, Recipe]:
    tokenizer = Recipe.from_model(default_model_path()).tokenizer
    return {"r1": Recipe.from_model(r1_tokenizer_dir(tmp_path_factory.mktemp("r1"), tokenizer)),
            "qwen3": Recipe.from_model(qwen3_tokenizer_dir(
                tmp_path_factory.mktemp("qwen3"), tokenizer, think_special=True))}


@pytest.fixture(scope="module")
def compiled(recipes) -> dict[str, Grammars]:
    """One Grammars per recipe (its vocabulary is read once)."""
    return {name: Grammars(lambda r=recipe: r.tokenizer, recipe.vocab_size,
                           recipe.eos_token_ids, blocking=True)
            for name, recipe in recipes.items()}


def start(grammars: Grammars, constraint: Constraint, output_ids=()) -> types.SimpleNamespace:
    req = types.SimpleNamespace(req_id=f"r{next(REQ_IDS)}", output_token_ids=list(output_ids),
                                params=SamplingParams(constraint=constraint))
    grammars.submit(req)
    ready, failed = grammars.take_ready()
    assert (ready, failed) == ([req], [])
    return req


def allowed(grammars: Grammars, req, token_id: int) -> bool:
    [row] = grammars.masks([req]).allowed
    return bool(row[token_id])


def walk(grammars: Grammars, req, ids: list[int]) -> None:
    """Append ids one by one, each one the mask allows."""
    for token_id in ids:
        assert allowed(grammars, req, token_id), token_id
        req.output_token_ids.append(token_id)


def one_token(recipe: Recipe, text: str) -> int:
    [token_id] = recipe.encode_reply_start(text)
    return token_id


def test_a_token_the_grammar_forbids_is_free_inside_the_thinking_only(recipes, compiled):
    recipe, g = recipes["r1"], compiled["r1"]
    word, tab, brace = (one_token(recipe, t) for t in ("hello", "\t", "{"))
    req = start(g, Constraint("json_schema", SCHEMA, thinking="open"))
    # inside the block: a word, a tab (a control byte the JSON ban covers) and `</think>`
    assert (allowed(g, req, word), allowed(g, req, tab), allowed(g, req, brace)) == \
        (True, True, True)
    walk(g, req, recipe.encode_reply_start("hello\tthere {x}\n</think>\n\n"))
    assert (allowed(g, req, word), allowed(g, req, tab), allowed(g, req, brace)) == \
        (False, False, True)
    walk(g, req, recipe.encode_reply_start('{"a": 7}'))
    assert allowed(g, req, recipe.eos_token_ids[0])
    # without the block the same word is forbidden from the first token
    plain = start(g, Constraint("json_schema", SCHEMA))
    assert (allowed(g, plain, word), allowed(g, plain, brace)) == (False, True)


def test_a_budget_continuation_replays_into_the_answer(recipes, compiled):
    recipe, g = recipes["r1"], compiled["r1"]
    brought = recipe.encode_reply_start("step step") + recipe.encode_reply_start(CLOSE_TEXT)
    req = start(g, Constraint("json_schema", SCHEMA, thinking="open"), brought)
    assert (allowed(g, req, one_token(recipe, "step")), allowed(g, req, one_token(recipe, "{"))) \
        == (False, True)


def test_may_open_takes_a_whole_block_or_the_answer_at_once(recipes, compiled):
    recipe, g = recipes["qwen3"], compiled["qwen3"]  # `<think>`/`</think>` special tokens
    word, brace = one_token(recipe, "hello"), one_token(recipe, "{")
    think = recipe.tokenizer.get_vocab()["<think>"]
    req = start(g, Constraint("json_schema", SCHEMA, thinking="may_open"))
    assert (allowed(g, req, word), allowed(g, req, think), allowed(g, req, brace)) == \
        (False, True, True)
    walk(g, req, recipe.encode_reply_start("<think>\nhello {\n</think>\n\n"))
    assert (allowed(g, req, word), allowed(g, req, brace)) == (False, True)


def test_a_marker_the_grammar_reads_as_a_token_is_matched_as_that_token(recipes):
    recipe = recipes["qwen3"]
    end = recipe.tokenizer.get_vocab()["</think>"]
    info = xgr.TokenizerInfo.from_huggingface(recipe.tokenizer, vocab_size=recipe.vocab_size,
                                              stop_token_ids=recipe.eos_token_ids)
    tag = thinking_tag(Constraint("regex", "[0-9]+", thinking="open"), {"</think>": end})
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(tag))
    spelled = recipe.encode_reply_start("hm </") + recipe.encode_reply_start("think>")
    assert end not in spelled  # the marker's text in sub-tokens stays thinking
    for token_id in spelled + [end] + recipe.encode_reply_start("\n\n42"):
        assert matcher.accept_token(token_id), token_id
    assert matcher.accept_token(recipe.eos_token_ids[0])
