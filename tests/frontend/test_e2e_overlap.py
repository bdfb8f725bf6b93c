"""End to end with overlapped scheduling forced on (`duplex serve --overlap on`; auto keeps it
off on the CPU): the worker lands each step's tokens only after launching the next, and the
official openai SDK must not see a difference. A request alone gives the offline engine's
greedy text (step by step, the same model, in the exact float32 mode: the fast quantized
mode's prompt and decode kernels round differently, so a prefix hit there may change a
near-tie), streamed or not, with one usage
chunk; concurrent streams, one of them closed early, all end properly and the server still
answers the same afterwards."""
from __future__ import annotations

import concurrent.futures
import importlib.util

import openai
import pytest

from duplex.engine.config import DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE
from duplex.engine.llm import LLM
from duplex.engine.sampling_params import SamplingParams
from tests.frontend.test_e2e_serve import Server

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None, reason="default model not installed")]

# few and short: the exact float32 mode is the slow one on the CPU (this file is about
# the overlap's bookkeeping, which a few requests exercise as well as many)
QUESTIONS = ["What is the capital of France?", "Name three colours.",
             "Count from one to five."]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve_overlap"),
                 ("--overlap", "on", "--dtype", "float32"))
    try:
        srv.wait_announced()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference() -> list[str]:
    """Each question alone through the offline API, step by step (overlap off)."""
    llm = LLM(None, progress=False, overlap="off", weights_dtype="float32", max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [llm.chat([{"role": "user", "content": q}], params)[0].text for q in QUESTIONS]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def ask(server, question: str, stream: bool) -> tuple[str, object]:
    kwargs = dict(model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": question}],
                  max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        reply = client(server).chat.completions.create(**kwargs)
        return reply.choices[0].message.content, reply.usage
    chunks = list(client(server).chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert [c for c in chunks if c.usage is not None] == chunks[-1:]  # one usage, last
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), \
        chunks[-1].usage


def test_a_request_alone_gives_the_step_by_step_engines_text(server, reference):
    for i, (question, want) in enumerate(zip(QUESTIONS, reference)):
        stream = i % 2 == 1  # both ways, each question once
        text, usage = ask(server, question, stream)
        assert text == want, (question, stream)
        assert 0 < usage.completion_tokens <= MAX_TOKENS


def test_concurrent_streams_and_one_closed_early_all_end(server, reference):
    def closed_early():
        stream = client(server).chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
            max_tokens=200, temperature=0, stream=True)
        next(iter(stream))
        stream.close()  # the worker aborts it while its step may be in flight

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        early = [pool.submit(closed_early) for _ in range(2)]
        streams = [pool.submit(ask, server, q, True) for q in QUESTIONS]
        results = [f.result(timeout=180) for f in streams]
        for f in early:
            f.result(timeout=180)
    for text, usage in results:
        assert text and 0 < usage.completion_tokens <= MAX_TOKENS
    assert ask(server, QUESTIONS[1], False)[0] == reference[1]  # still the same server
