"""Workload generators: exact lengths, determinism under a seed, and the sharing they claim."""
from __future__ import annotations

import json
import os
import random

import pytest

from duplex.bench.text import TextSource
from duplex.bench.workloads import (AGENT_HEADER, WorkloadOptions, build_workload, default_trace_path,
                             random_lengths, random_workload, read_trace)


def build(name, text_source, **options):
    return build_workload(name, text_source, WorkloadOptions(**options))


def contents(conversation):
    return [m["content"] for turn in conversation.turns for m in turn.messages]


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 257, 3000])
def test_text_windows_have_exact_lengths(text_source, num_tokens):
    window = text_source.window(num_tokens, random.Random(num_tokens))
    assert len(window.token_ids) == num_tokens
    assert text_source.encode(window.text) == window.token_ids


def test_text_windows_concatenate_token_for_token(text_source):
    windows = [text_source.window(16, random.Random(i)) for i in range(40)]
    joined = "".join(w.text for w in windows)
    assert text_source.encode(joined) == [t for w in windows for t in w.token_ids]


def test_text_is_varied_prose_not_repeated_tokens(text_source):
    window = text_source.window(500, random.Random(0))
    assert len(set(window.token_ids)) > 200
    assert " the " in window.text


@pytest.mark.parametrize("name", ["random", "shared-prefix", "multi-turn", "agent"])
def test_workloads_are_deterministic_under_a_seed(tokenizer, name):
    options = dict(num_requests=5, input_len=20, system_len=30, num_groups=2,
                   prompts_per_group=3, num_conversations=3, num_turns=2, tool_output_len=10)
    # A fresh TextSource each time: nothing may depend on what was generated before.
    first = build(name, TextSource(tokenizer, seed=1), seed=1, **options)
    again = build(name, TextSource(tokenizer, seed=1), seed=1, **options)
    other = build(name, TextSource(tokenizer, seed=2), seed=2, **options)
    assert first == again
    assert first.conversations != other.conversations


def test_random_prompts_have_exact_lengths_and_share_nothing(text_source):
    workload = build("random", text_source, num_requests=20, input_len=64, output_len=7)
    assert workload.num_requests == 20
    prompts = [c.turns[0].messages[0]["content"] for c in workload.conversations]
    assert all(text_source.count(p) == 64 for p in prompts)
    assert len({tuple(text_source.encode(p)[:4]) for p in prompts}) == 20
    assert all(c.turns[0].max_tokens == 7 for c in workload.conversations)


def test_shared_prefix_groups_share_their_system_prompt(text_source):
    workload = build("shared-prefix", text_source, num_groups=3, prompts_per_group=4,
                     system_len=100, input_len=20)
    assert workload.num_requests == 12
    systems = [c.turns[0].messages[0] for c in workload.conversations]
    assert all(m["role"] == "system" and text_source.count(m["content"]) == 100 for m in systems)
    by_prefix = {}
    for c in workload.conversations:
        user = c.turns[0].messages[1]["content"]
        assert text_source.count(user) == 20
        by_prefix.setdefault(c.turns[0].messages[0]["content"], []).append(user)
    assert sorted(len(users) for users in by_prefix.values()) == [4, 4, 4]
    assert len({u for users in by_prefix.values() for u in users}) == 12
    order = [list(by_prefix).index(s["content"]) for s in systems]
    assert order != sorted(order)                          # groups arrive interleaved


def test_multi_turn_shares_one_system_prompt_and_adds_a_user_message_per_turn(text_source):
    workload = build("multi-turn", text_source, num_conversations=3, num_turns=4,
                     system_len=50, input_len=12)
    assert workload.num_requests == 12
    system = workload.conversations[0].turns[0].messages[0]
    for c in workload.conversations:
        assert c.turns[0].messages[0] == system
        assert [len(t.messages) for t in c.turns] == [2, 1, 1, 1]
        assert all(t.messages[-1]["role"] == "user" for t in c.turns)
        assert all(text_source.count(t.messages[-1]["content"]) == 12 for t in c.turns)


@pytest.mark.parametrize("mark, has_header, has_tools",
                         [("header", True, False), ("tools", False, True), ("both", True, True)])
def test_agent_steps_append_tool_results_and_mark_the_traffic(text_source, mark, has_header,
                                                               has_tools):
    workload = build("agent", text_source, num_conversations=2, num_turns=3, system_len=40,
                     input_len=10, tool_output_len=30, agent_mark=mark)
    for c in workload.conversations:
        assert (AGENT_HEADER in c.headers) == has_header
        assert bool(c.tools) == has_tools
        assert [m["role"] for m in c.turns[0].messages] == ["system", "user"]
        for turn in c.turns[1:]:
            (result,) = turn.messages
            assert result["content"].startswith("Tool result:")
            assert text_source.count(result["content"].removeprefix("Tool result:")) == 30


def write_trace(path, entries):
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return str(path)


def test_mooncake_common_hash_prefix_means_common_token_prefix(text_source, tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl", [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 2000, "output_length": 20, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 3000, "input_length": 600, "output_length": 5000, "hash_ids": [0, 5]},
        {"timestamp": 4000, "input_length": 100, "output_length": 1, "hash_ids": [6]},
    ])
    workload = build("mooncake", text_source, trace=trace, tokens_per_block=16, time_scale=2.0,
                     max_model_len=512)
    ids = [text_source.encode(c.turns[0].messages[0]["content"]) for c in workload.conversations]
    assert [len(i) for i in ids] == [48, 64, 32, 16]
    assert ids[0][:32] == ids[1][:32] and ids[0][32:48] != ids[1][32:48]
    assert ids[0][:16] == ids[2][:16] and ids[0][16:32] != ids[2][16:32]
    assert ids[3][:16] != ids[0][:16]
    assert [c.arrival_s for c in workload.conversations] == [0.0, 0.5, 1.5, 2.0]
    max_tokens = [c.turns[0].max_tokens for c in workload.conversations]
    assert max_tokens == [10, 20, 512 - 64 - 32, 1]        # the long output clipped to fit


def test_mooncake_context_limit_keeps_the_leading_blocks(text_source, tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl", [
        {"timestamp": 0, "input_length": 50000, "output_length": 8, "hash_ids": list(range(100))}])
    workload = build("mooncake", text_source, trace=trace, tokens_per_block=16, max_model_len=512)
    prompt = workload.conversations[0].turns[0].messages[0]["content"]
    assert text_source.count(prompt) == (512 - 64 - 1) // 16 * 16


@pytest.mark.skipif(not os.path.exists(default_trace_path()), reason="shared trace not present")
def test_mooncake_replays_the_shared_trace(text_source):
    workload = build("mooncake", text_source, max_requests=30, tokens_per_block=8)
    entries = read_trace(default_trace_path(), 30)
    assert workload.num_requests == 30
    for conversation, entry in zip(workload.conversations, entries):
        prompt = conversation.turns[0].messages[0]["content"]
        assert text_source.count(prompt) == 8 * len(entry["hash_ids"])
        assert conversation.arrival_s == entry["timestamp"] / 1000


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="input_len"):
        WorkloadOptions(input_len=0)
    with pytest.raises(ValueError, match="agent_mark"):
        WorkloadOptions(agent_mark="shout")


def test_mooncake_sessions_keep_whole_sessions_in_trace_order(text_source, tmp_path):
    lines = [  # sessions by second hash id: 7 (3 requests), 8 (2: too short), 9 (3)
        {"timestamp": 100, "output_length": 4, "hash_ids": [0, 7]},
        {"timestamp": 200, "output_length": 4, "hash_ids": [0, 8]},
        {"timestamp": 300, "output_length": 4, "hash_ids": [0, 9]},
        {"timestamp": 400, "output_length": 4, "hash_ids": [0, 7, 1]},
        {"timestamp": 500, "output_length": 4, "hash_ids": [0, 8, 2]},
        {"timestamp": 600, "output_length": 4, "hash_ids": [0, 9, 3]},
        {"timestamp": 700, "output_length": 4, "hash_ids": [0, 7, 1, 4]},
        {"timestamp": 800, "output_length": 4, "hash_ids": [0, 9, 3, 5]},
        {"timestamp": 900, "output_length": 4, "hash_ids": [0]},
    ]
    trace = write_trace(tmp_path / "trace.jsonl", lines)
    one = build("mooncake", text_source, trace=trace, tokens_per_block=4, sessions=1)
    assert [c.arrival_s for c in one.conversations] == [0.0, 0.3, 0.6]  # rebased to t=100
    prompts = [c.turns[0].messages[0]["content"] for c in one.conversations]
    assert prompts[1].startswith(prompts[0]) and prompts[2].startswith(prompts[1])
    two = build("mooncake", text_source, trace=trace, tokens_per_block=4, sessions=5)
    assert [text_source.count(c.turns[0].messages[0]["content"]) // 4
            for c in two.conversations] == [2, 2, 3, 3, 4, 4]
    capped = build("mooncake", text_source, trace=trace, tokens_per_block=4, sessions=5,
                   max_requests=4)
    assert capped.num_requests == 4
    with pytest.raises(ValueError, match="sessions"):
        WorkloadOptions(sessions=-1)


def test_random_prompts_with_a_length_range(text_source):
    options = WorkloadOptions(num_requests=40, input_len=10, output_len=5, seed=3)
    spread = random_workload(text_source, options, max_input_len=30)
    lengths = [text_source.count(c.turns[0].messages[0]["content"]) for c in spread.conversations]
    assert lengths == random_lengths(options, 30)
    assert min(lengths) >= 10 and max(lengths) <= 30 and len(set(lengths)) > 10
    assert spread.params == {"seed": 3, "num_requests": 40, "input_len": 10, "output_len": 5,
                             "max_input_len": 30}
    with pytest.raises(ValueError, match="below input_len"):
        random_workload(text_source, options, max_input_len=9)


def test_random_workload_without_a_range_is_unchanged(tokenizer):
    options = WorkloadOptions(num_requests=4, input_len=12, seed=5)
    assert random_workload(TextSource(tokenizer, seed=5), options) == \
        build_workload("random", TextSource(tokenizer, seed=5), options)
    assert random_lengths(options, None) == [12] * 4
