"""The thinking budget on the real engine: a tiny random Qwen3 model carrying
DeepSeek-R1-Distill-Qwen's chat template (whose prompt opens `<think>`, so every token is
reasoning until the block closes). When the budget is spent the pipeline ends the engine
request and continues it with the tokens so far plus the closing marker as
`AddRequest.output_token_ids`; what the engine writes after them must be exactly what
transformers writes greedily after the same tokens."""
from __future__ import annotations

import asyncio

import pytest
import torch

from duplex.engine.config import default_model_path
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.text.messages import Chat
from duplex.engine.text.reasoning import CLOSE_TEXT, ReasoningFormat
from duplex.engine.text.recipe import Recipe
from duplex.frontend.generation import Delta, Job, Pipeline, collect
from duplex.frontend.metrics import Metrics
from tests.engine.conftest import hf_greedy, hf_model, make_core
from tests.text.reasoning_models import r1_tokenizer_dir

MAX_TOKENS, BUDGET = 14, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A random Qwen3 model and the R1-Distill tokenizer in one Hugging Face directory."""
    import transformers
    path = tmp_path_factory.mktemp("r1_tiny")
    r1_tokenizer_dir(path, Recipe.from_model(default_model_path()).tokenizer)
    vocab_size = len(Recipe.from_model(str(path)).tokenizer)
    config = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return str(path)


class CoreEngine:
    """The pipeline's engine, in process: EngineCore stepped on the loop, one request at a
    time; closing a stream aborts its request (as the worker does)."""
    ready_info = None

    def __init__(self, core) -> None:
        self.core = core
        self.added = []

    async def generate(self, msg):
        self.added.append(msg)
        self.core.add_request(msg)
        try:
            while True:
                for delta in self.core.step():
                    if delta.req_id == msg.req_id:
                        yield delta
                        if delta.finish_reason is not None:
                            return
                await asyncio.sleep(0)
        finally:
            self.core.abort_requests([msg.req_id])


async def test_budget_cut_continues_exactly_after_the_closing_marker(model_dir):
    recipe = Recipe.from_model(model_dir)
    engine = CoreEngine(make_core(model_dir))
    pipeline = Pipeline(engine, recipe, Metrics(),
                        reasoning=ReasoningFormat.for_recipe("deepseek_r1", recipe))
    prompt = recipe.encode_chat(Chat.from_dicts([{"role": "user", "content": "hi"}]))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    job = Job(req_id="r", prompt_token_ids=prompt, params=params, parse_reasoning=True,
              thinking_budget=BUDGET)
    events = []

    async def record():
        async for event in pipeline.run(job):
            events.append(event)
            yield event

    [result] = await collect(record(), 1)
    first, second = engine.added
    close_ids = recipe.encode_reply_start(CLOSE_TEXT)
    thought = second.output_token_ids[:BUDGET]
    assert second.output_token_ids == thought + close_ids
    assert second.prompt_token_ids == first.prompt_token_ids == prompt
    reference, _ = hf_greedy(hf_model(model_dir), prompt, BUDGET)
    assert thought == reference  # the model's own first tokens, cut at the budget
    num_after = MAX_TOKENS - BUDGET - len(close_ids)
    after, _ = hf_greedy(hf_model(model_dir), prompt + thought + close_ids, num_after)
    assert result.token_ids == thought + close_ids + after
    assert result.final.finish_reason == "length"
    assert result.final.usage.completion_tokens == MAX_TOKENS
    assert result.final.usage.reasoning_tokens == BUDGET
    assert result.reasoning == recipe.decode(thought).strip()
    assert result.text == recipe.decode(after).lstrip()
    assert all(isinstance(e, Delta) for e in events[:-1])


async def test_next_turn_hits_the_prefix_cache_with_reasoning_dropped(model_dir):
    """R1's template drops the earlier turn's reasoning: the next prompt shares the first
    turn's prompt up to its `<think>`, and those blocks are cache hits."""
    recipe = Recipe.from_model(model_dir)
    block_size = 8
    engine = CoreEngine(make_core(model_dir, block_size=block_size))
    pipeline = Pipeline(engine, recipe, Metrics(),
                        reasoning=ReasoningFormat.for_recipe("deepseek_r1", recipe))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    turns = [{"role": "user", "content": "What is two plus two, and why?"}]
    first_prompt = recipe.encode_chat(Chat.from_dicts(turns))
    [first] = await collect(pipeline.run(Job("t1", first_prompt, params, parse_reasoning=True)), 1)
    turns += [{"role": "assistant", "content": "Four.", "reasoning_content": first.reasoning},
              {"role": "user", "content": "And three?"}]
    second_prompt = recipe.encode_chat(Chat.from_dicts(turns))
    [second] = await collect(pipeline.run(Job("t2", second_prompt, params,
                                              parse_reasoning=True)), 1)
    shared = next(i for i, (a, b) in enumerate(zip(first_prompt, second_prompt)) if a != b)
    assert shared == len(first_prompt) - len(recipe.encode_reply_start("<think>\n"))
    assert second.final.usage.cached_tokens == shared // block_size * block_size > 0
