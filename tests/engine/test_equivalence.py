"""Invariant 1: greedy output equals Hugging Face transformers on the same weights, at
batch 1 and in mixed batches, with chunked prefill and under preemption."""
from __future__ import annotations

import functools

import pytest
import torch

from duplex.engine.sampling_params import SamplingParams
from duplex.engine.text.tokenizer import load_tokenizer
from tests.engine.conftest import hf_greedy, hf_model, make_core, run_engine

# 32 new tokens: long enough that a wrong KV entry or position shows in the greedy tokens and
# logprobs of every layout, short enough for the suite's budget (the reference is 8 x 32 steps)
NUM_NEW = 32
TEXTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and then list three colours that appear "
    "at sunset. Be concise but accurate, and avoid jargon where you can.",
    "def fibonacci(n):",
    "Translate to French: The cat sleeps on the warm windowsill every afternoon.",
    "Count from one to ten.",
    "Here is a long story. " + "Once upon a time a small robot wandered through a quiet "
    "village, greeting every neighbour it met and asking each one about their day. " * 6,
    "Hi",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)


@functools.lru_cache(maxsize=1)
def prompts_and_reference(path: str):
    tok = load_tokenizer(path)  # Duplex's cached conversion; the reference is the model
    prompts = []
    for i, text in enumerate(TEXTS):
        if i % 2:  # half as chats, half as raw text
            ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                          add_generation_prompt=True, tokenize=False)
            prompts.append(tok.encode(ids, add_special_tokens=False))
        else:
            prompts.append(tok.encode(text, add_special_tokens=False))
    model = hf_model(path)
    return prompts, [hf_greedy(model, p, NUM_NEW) for p in prompts]


# batch 1: the long raw prompt and the shortest chat (each prompt is a whole engine run of
# its own; the batched layouts take all eight)
ALONE = (6, 7)


def assert_matches(results, reference, which):
    assert sorted(results) == sorted(f"r{i}" for i in which)
    for i in which:
        ref_tokens, ref_logprobs = reference[i]
        tokens, logprobs = results[f"r{i}"]
        assert tokens == ref_tokens, f"prompt {i}: tokens differ from transformers"
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs),
                                   atol=1e-3, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one_at_a_time", "all_together", "staggered",
                                    "chunked_prefill", "preemption"])
def test_smollm2_greedy_matches_transformers(default_model, layout):
    prompts, reference = prompts_and_reference(default_model)
    kwargs = {}
    if layout == "chunked_prefill":
        kwargs = dict(max_num_batched_tokens=16)
    if layout == "preemption":
        longest = max(len(p) for p in prompts) + NUM_NEW
        kwargs = dict(num_kv_blocks=(longest // 16 + 1) * 2 + 2)
    core = make_core(default_model, **kwargs)
    if layout == "one_at_a_time":
        results = {}
        for i in ALONE:
            results[f"r{i}"] = run_engine(core, [prompts[i]], GREEDY)["r0"]
    elif layout == "staggered":
        results = run_engine(core, prompts, GREEDY, arrivals=[0, 0, 3, 5, 5, 9, 20, 21])
    else:
        results = run_engine(core, prompts, GREEDY)
    assert_matches(results, reference, ALONE if layout == "one_at_a_time" else range(len(TEXTS)))
    if layout == "preemption":
        assert core.scheduler.num_preemptions > 0, "the tiny pool should force preemption"
    assert core.pool.num_used_blocks == 0, "every block is released at the end"
