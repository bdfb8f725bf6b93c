"""What runs where (frontend.offload), without timing: big bodies are decoded, rendered and
tokenized in the pool thread, small ones inline; a request's own template always goes to the
pool; a body is read chunk by chunk; a prompt too long for any tokenization is refused
before the recipe sees it."""
from __future__ import annotations

import asyncio
import threading

from frontend_fakes import FakeRecipe

from duplex.frontend.offload import CpuPool, check_prompt_chars, longest_token_chars, text_chars


class ThreadRecordingRecipe(FakeRecipe):
    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def encode_chat(self, chat, **kwargs):
        self.threads.append(threading.current_thread().name)
        return super().encode_chat(chat, **kwargs)


async def test_big_bodies_and_request_templates_are_worked_on_in_the_pool(make_harness):
    h = await make_harness(allow_request_chat_template=True)
    recipe = h.state.recipe = h.state.pipeline.recipe = ThreadRecordingRecipe()
    small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    big = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
           "metadata_padding": "x" * 100_000}  # unknown fields are ignored, but weigh
    templated = {**small, "chat_template": "plain"}
    for body in (small, big, templated):
        assert (await h.post("/v1/chat/completions", body)).status == 200
    on_loop, in_pool, templated_in = recipe.threads
    assert on_loop == threading.current_thread().name  # the test shares the server's loop
    assert in_pool.startswith("request-cpu") and templated_in.startswith("request-cpu")
    # `big`: joining its chunks, decoding, rendering; `templated`: rendering only
    assert h.state.cpu.num_offloaded == 3 + 1
    assert (await h.post("/v1/messages", {**small, "extra": "y" * 100_000})).status == 200
    assert recipe.threads[-1].startswith("request-cpu") and h.state.cpu.num_offloaded == 7


async def test_a_body_is_read_in_steps_not_one_long_one():
    class Content:
        async def iter_any(self):
            for _ in range(50):
                yield b"x" * 1000

    class Request:
        content = Content()

    pool = CpuPool(inline_below=10**6)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    body = await pool.read_body(Request())
    task.cancel()
    assert body == b"x" * 50_000 and ticks >= 40  # the loop ran between chunks
    pool.close()


def test_a_prompt_too_long_for_any_tokenization_is_refused_first():
    check_prompt_chars(512 * 81, 512, 81, "messages")
    try:
        check_prompt_chars(512 * 81 + 1, 512, 81, "messages")
    except Exception as e:  # noqa: BLE001 - the ApiError
        assert e.kind == "invalid_request" and "81 characters per token" in e.message
    else:
        raise AssertionError("not refused")
    check_prompt_chars(10**9, 512, None, "messages")  # no tokenizer: no bound
    # every string counts, keys included (a template may print them)
    assert text_chars([{"role": "user", "content": ["ab", {"text": "cde"}]}]) == 24
    assert longest_token_chars(FakeRecipe()) is None
