"""Grammar-constrained decoding inside EngineCore, on a tiny random model whose text is
noise unless the grammar shapes it: every output matches its constraint; speculation,
preemption and a prefill -> decode hand-off leave constrained outputs identical; a grammar
still compiling does not hold up other requests; logit_bias moves the sampler."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import msgspec
import pytest

from duplex.engine.kv_transfer import prefill_part
from duplex.engine.messages import AddRequest
from duplex.engine.sampling_params import Constraint, SamplingParams
from duplex.engine.text.tokenizer import load_tokenizer
from tests.structured.conftest import make_core

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "home": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                 "required": ["ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "home"],
    "additionalProperties": False,
}
REGEX = r"(19|20)[0-9]{2}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]
# (json_object is open-ended, so a random model runs it to max_tokens: tests/structured/
# test_structured_api.py covers it on the default model)
CONSTRAINTS = [Constraint("json_schema", json.dumps(SCHEMA)), Constraint("regex", REGEX),
               Constraint("choice", json.dumps(CHOICES))]


@pytest.fixture(scope="module")
def core(tiny_model):
    return make_core(tiny_model, weights_dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in
            ("Describe an animal.", "A year and a code:", "Pick a color")]


def _run(core, msgs: list[AddRequest]) -> dict[str, tuple[list[int], str | None]]:
    out = {m.req_id: [] for m in msgs}
    finish = {}
    for msg in msgs:
        core.add_request(msg)
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for delta in core.step():
            out[delta.req_id] += delta.new_token_ids
            if delta.finish_reason:
                finish[delta.req_id] = delta.finish_reason
    return {k: (out[k], finish.get(k)) for k in out}


def _greedy(constraint, max_tokens=120, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint, **kw)


def _check(text: str, constraint: Constraint) -> None:
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif constraint.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif constraint.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES


def _texts(core, tokenizer, params_of) -> dict[str, tuple[list[int], str]]:
    msgs = [AddRequest(f"r{i}", ids, params_of(c))
            for i, (ids, c) in enumerate(zip(_prompts(tokenizer), CONSTRAINTS))]
    return _run(core, msgs)


@pytest.fixture(scope="module")
def plain(core, tokenizer):
    """Greedy constrained outputs of the four prompts, batched, nothing else going on."""
    return _texts(core, tokenizer, _greedy)


def test_every_output_matches_its_constraint_greedy_and_sampled(core, tokenizer, plain):
    free = _run(core, [AddRequest("free", _prompts(tokenizer)[0],
                                  SamplingParams(temperature=0.0, max_tokens=12))])
    text = tokenizer.decode(free["free"][0], skip_special_tokens=True)
    with pytest.raises(ValueError):  # unconstrained, the random model writes no JSON
        json.loads(text)
    sampled = _texts(core, tokenizer, lambda c: SamplingParams(temperature=1.0, max_tokens=120,
                                                              constraint=c))
    for outs in (plain, sampled):
        for (ids, finish), constraint in zip(outs.values(), CONSTRAINTS):
            assert finish == "stop", (constraint.kind, finish)
            _check(tokenizer.decode(ids, skip_special_tokens=True), constraint)


def test_speculation_leaves_constrained_greedy_output_identical(core, tiny_model, tokenizer,
                                                               plain):
    # a fixed cost line, not one measured on this machine: whether drafting pays must not
    # depend on the box's timings (CI once measured a curve on which no draft ever paid)
    spec_core = make_core(tiny_model, weights_dtype="float32", speculation="ngram",
                          num_draft_tokens=4, spec_confidence=False, spec_token_cost=0.05)
    spec = _texts(spec_core, tokenizer, _greedy)
    assert spec == plain
    stats = spec_core.spec.stats  # drafts were made, some kept, some cut or rejected
    assert stats.proposed.sum() > stats.accepted.sum() > 0


def test_a_handoff_and_preemption_leave_constrained_output_identical(core, tiny_model,
                                                                     tokenizer, plain):
    # prefill side: the prompt and the first token only; decode side: continues after it
    msgs = [AddRequest(f"r{i}", ids, _greedy(c))
            for i, (ids, c) in enumerate(zip(_prompts(tokenizer), CONSTRAINTS))]
    first = _run(core, [prefill_part(m) for m in msgs])
    resumed = _run(core, [msgspec.structs.replace(m, output_token_ids=first[m.req_id][0])
                          for m in msgs])
    assert {k: (first[k][0] + ids, finish) for k, (ids, finish) in resumed.items()} == plain
    # three schema outputs in a KV pool too small for them at once: requests are preempted
    # and recomputed
    schema_msgs = [AddRequest(f"s{i}", ids, _greedy(CONSTRAINTS[0]))
                   for i, ids in enumerate(_prompts(tokenizer))]
    small = make_core(tiny_model, weights_dtype="float32", num_kv_blocks=8, block_size=16)
    assert _run(small, schema_msgs) == _run(core, schema_msgs)
    assert small.scheduler.num_preemptions > 0


def test_a_compiling_grammar_does_not_hold_up_other_requests(core, tokenizer):
    release = threading.Event()
    original = core.grammar._compile

    def slow_compile(constraint):
        release.wait(30)
        return original(constraint)

    core.grammar._compile = slow_compile
    try:
        unique = Constraint("regex", "[a-c]{3}x")  # not cached yet
        core.add_request(AddRequest("slow", _prompts(tokenizer)[0], _greedy(unique)))
        core.add_request(AddRequest("fast", _prompts(tokenizer)[1],
                                    SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True)))
        done = {}
        for _ in range(50):
            for delta in core.step():
                done.setdefault(delta.req_id, []).extend(delta.new_token_ids)
            if "fast" in done and len(done["fast"]) == 8:
                break
        assert len(done["fast"]) == 8 and "slow" not in done
        assert core.grammar.is_waiting("slow")
    finally:
        release.set()
        core.grammar._compile = original
    tokens = []
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        for delta in core.step():
            tokens += delta.new_token_ids
    assert re.fullmatch("[a-c]{3}x", tokenizer.decode(tokens, skip_special_tokens=True))


def test_a_grammar_the_engine_cannot_compile_ends_the_request_with_an_error(core, tokenizer):
    bad = Constraint("grammar", "root ::= undefined_rule")
    out = _run(core, [AddRequest("bad", _prompts(tokenizer)[0], _greedy(bad)),
                      AddRequest("good", _prompts(tokenizer)[1], _greedy(CONSTRAINTS[1]))])
    assert out["bad"] == ([], "error")
    assert out["good"][1] == "stop"


def test_logit_bias_moves_greedy_choices(core, tokenizer):
    prompt = _prompts(tokenizer)[0]
    base = _run(core, [AddRequest("b", prompt, SamplingParams(temperature=0.0, max_tokens=6))])
    first = base["b"][0][0]
    token = tokenizer.encode(" hello")[0]
    biased = _run(core, [
        AddRequest("up", prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                logit_bias={token: 100.0})),
        AddRequest("down", prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                  logit_bias={first: -100.0}))])
    assert biased["up"][0] == [token] * 6
    assert biased["down"][0][0] != first


def test_a_constraint_and_a_logit_bias_cross_the_wire_as_data():
    from duplex.engine.messages import decode_to_worker, encode

    params = SamplingParams(max_tokens=4, logit_bias={7: -2.5, 9: 100.0},
                            constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    frame = encode(AddRequest("w", [1, 2], params))
    assert b"\x80\x04" not in frame[:2]  # msgpack, not a pickle protocol header
    assert decode_to_worker(frame).params == params
    with pytest.raises(ValueError, match="constraint.kind"):
        Constraint("python", "import os")
