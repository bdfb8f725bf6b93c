"""The baseline server: its streaming, stopping and batching on a scripted fake model (fast),
and one real run on the default model (slow)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from aiohttp.test_utils import TestServer

from duplex.bench import cli
from duplex.bench.baseline_server import BaselineEngine, BaselineServer
from duplex.bench.runner import LoadConfig, run_load
from duplex.bench.workloads import Conversation, Turn

EOS = 2


class ScriptedModel:
    """Stands in for a transformers model: every row generates the same scripted tokens."""

    def __init__(self, script: list[int], context_len: int = 128):
        self.script = script
        self.config = SimpleNamespace(max_position_embeddings=context_len)
        self.generation_config = SimpleNamespace(eos_token_id=EOS)
        self.batch_sizes: list[int] = []

    def generate(self, input_ids, attention_mask, generation_config, streamer,
                 stopping_criteria):
        assert input_ids.shape == attention_mask.shape
        self.batch_sizes.append(input_ids.shape[0])
        streamer.put(input_ids)
        ids = input_ids
        for step in range(generation_config.max_new_tokens):
            new = torch.full((ids.shape[0],), self.script[step % len(self.script)])
            ids = torch.cat([ids, new[:, None]], dim=1)
            is_done = stopping_criteria(ids, None)
            streamer.put(new)
            if bool(is_done.all()):
                break
        streamer.end()


@pytest.fixture
def words(tokenizer) -> list[int]:
    return list(tokenizer.encode(" hello world again", add_special_tokens=False))


async def serve_and_run(tokenizer, model, turns: list[Turn], batch_size: int = 1, **load):
    engine = BaselineEngine(model, tokenizer, batch_size=batch_size, batch_window_s=0.2)
    server = TestServer(BaselineServer(engine, "fake").app(), host="127.0.0.1")
    await server.start_server()
    try:
        conversations = [Conversation(i, (turn,)) for i, turn in enumerate(turns)]
        config = LoadConfig(url=str(server.make_url("")).rstrip("/"), progress=False,
                            concurrency=len(turns), **load)
        return (await run_load(conversations, config)).records
    finally:
        await server.close()


def user_turn(max_tokens: int) -> Turn:
    return Turn(({"role": "user", "content": "Say hello."},), max_tokens)


async def test_stops_at_eos_unless_told_to_ignore_it(tokenizer, words):
    model = ScriptedModel([*words, EOS])
    (stop,) = await serve_and_run(tokenizer, model, [user_turn(10)], ignore_eos=False)
    assert stop.status == "ok", stop.detail
    assert stop.text == " hello world again"
    assert stop.completion_tokens == len(words) + 1 and stop.cached_tokens == 0
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}],
                                           add_generation_prompt=True, tokenize=False)
    assert stop.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    (ignore,) = await serve_and_run(tokenizer, model, [user_turn(6)], ignore_eos=True)
    assert ignore.completion_tokens == 6
    assert ignore.text == " hello world again hello world"
    assert len(ignore.chunk_s) >= 5


async def test_static_batch_serves_each_request_its_own_length(tokenizer, words):
    model = ScriptedModel(words)
    records = await serve_and_run(tokenizer, model, [user_turn(2), user_turn(5)], batch_size=2)
    assert [r.status for r in records] == ["ok", "ok"]
    assert sorted(r.completion_tokens for r in records) == [2, 5]
    assert model.batch_sizes == [2]


async def test_bad_requests_get_400(tokenizer):
    engine = BaselineEngine(ScriptedModel([EOS], context_len=16), tokenizer)
    server = TestServer(BaselineServer(engine, "fake").app(), host="127.0.0.1")
    await server.start_server()
    import aiohttp
    try:
        async with aiohttp.ClientSession() as session:
            url = str(server.make_url("/v1/chat/completions"))
            for body in ({"messages": []}, {"messages": [{"content": "x"}]},
                         {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
                         {"messages": [{"role": "user", "content": "word " * 50}]}):
                async with session.post(url, json=body) as response:
                    assert response.status == 400
                    assert "message" in (await response.json())["error"]
            async with session.post(url, data=b"{not json") as response:
                assert response.status == 400
    finally:
        await server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "baseline server exited during start-up"
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("baseline server did not become healthy")


@pytest.mark.slow
def test_serve_against_the_baseline_on_the_default_model(tokenizer, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "duplex.frontend.cli", "bench", "baseline-server", "--port", str(port),
         "--batch-size", "2", "--threads", "1"],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(url, process, timeout_s=240)
        rc = cli.main(["serve", "--url", url, "--num-requests", "2", "--concurrency", "2",
                       "--input-len", "16", "--output-len", "4", "--skip-machine",
                       "--no-progress", "--no-plots", "--out", str(tmp_path), "--label", "hf"])
        assert rc == 0
        summary = json.loads((tmp_path / "hf.json").read_text())["summary"]
        assert summary["completed"] == 2 and summary["failed"] == 0
        assert summary["output_tokens"] == 8                  # ignore_eos: exactly 4 each
        assert summary["cache_hit_rate"] == 0.0
        assert summary["prompt_tokens"] > 2 * 16
    finally:
        process.terminate()
        process.wait(30)
