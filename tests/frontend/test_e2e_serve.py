"""End to end: `duplex serve` as a subprocess with the real default model, driven by the
official openai and anthropic SDKs, a WebSocket client and raw HTTP. Covers streaming and
usage, prefix-cache hits, a SIGKILLed worker (one terminal error per stream, then recovery)
and SIGTERM drain. Tests run in file order on one server; the last one stops it."""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import openai
import pytest
import requests
from websockets.sync.client import connect

from duplex.engine.config import DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 240
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None, reason="default model not installed")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# One torch thread per test server: `make test` runs two test processes on two cores, and a
# server's own two threads beside them oversubscribe the cores (test_e2e_overlap beside
# test_equivalence took 46 s with them and 4.4 s with one, the neighbour 145 s and 90 s).
SERVER_THREADS = ("--num-threads", "1")


class Server:
    def __init__(self, tmp_dir: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_dir / "serve.log"
        self.lines: queue.Queue[str] = queue.Queue()
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        env.pop("TRITON_INTERPRET", None)  # as a user starts it: a CPU server runs no triton
        self.process = subprocess.Popen(
            [sys.executable, "-m", "duplex.frontend.cli", "serve", "--port", str(self.port),
             "--num-kv-blocks", "256", "--max-model-len", "2048", "--shutdown-timeout", "150",
             "--request-timeout", "300", "--log-level", "info", "--log-format", "json",
             *SERVER_THREADS, *extra_args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"),
            text=True, start_new_session=True)
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)

    def wait_announced(self) -> str:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.process.poll() is None, self.log_tail()
                continue
            # --log-format json: the banner too is one JSON log line
            message = json.loads(line)["msg"] if line.startswith("{") else line
            if message.startswith("Duplex is serving"):
                return message
        raise AssertionError(f"server not ready in {STARTUP_S} s\n{self.log_tail()}")

    def wait_health(self, status: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == status:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"/health never answered {status}\n{self.log_tail()}")

    def worker_pids(self) -> list[int]:
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in children.read_text().split()]

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve"))
    try:
        srv.announcement = srv.wait_announced()
        yield srv
    finally:
        srv.stop()


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def test_announces_url_and_is_healthy(server):
    assert f"at {server.url}" in server.announcement
    assert requests.get(server.url + "/health").json()["status"] == "ok"
    models = oai(server).models.list()
    assert models.data[0].id == DEFAULT_MODEL_NAME
    status = requests.get(server.url + "/v1/status").json()
    assert status["layout"] == {"unified": 1} and status["max_model_len"] == 2048
    [worker] = status["workers"]
    assert worker["state"] == "running" and worker["pid"] == server.worker_pids()[0]


def test_openai_chat_streaming_matches_non_streaming_and_hits_the_cache(server):
    client = oai(server)
    reply = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION,
                                           max_tokens=8, temperature=0)
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert reply.usage.completion_tokens <= 8
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert usage.prompt_tokens == reply.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_openai_completions(server):
    reply = oai(server).completions.create(model=DEFAULT_MODEL_NAME, prompt="One, two, three,",
                                           max_tokens=5, temperature=0, logprobs=2)
    assert reply.choices[0].text and reply.usage.completion_tokens == 5
    assert len(reply.choices[0].logprobs.tokens) == 5
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_only_the_worker_holds_torch_and_a_cpu_worker_no_triton(server):
    """The frontend tokenizes, renders and streams without torch (the default model's
    frontend went from 395 to 137 MB of RSS when it stopped loading it); the worker holds it.
    A CPU worker imports triton only for its interpreter (TRITON_INTERPRET=1, as the tests
    set it), so this server's worker, started without it, holds no triton (~70 MB)."""
    reply = oai(server).chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION,
                                                max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens > 0
    frontend = Path(f"/proc/{server.process.pid}/maps").read_text()
    worker = Path(f"/proc/{server.worker_pids()[0]}/maps").read_text()
    assert "libtorch_cpu" not in frontend and "libtorch_cpu" in worker
    assert "libtriton" not in worker


def test_anthropic_messages_streaming_and_count_tokens(server):
    client = claude(server)
    count = client.messages.count_tokens(model=DEFAULT_MODEL_NAME, messages=QUESTION)
    message = client.messages.create(model=DEFAULT_MODEL_NAME, max_tokens=6,
                                     messages=QUESTION, extra_body={"temperature": 0})
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == count.input_tokens
    assert message.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(model=DEFAULT_MODEL_NAME, max_tokens=6, messages=QUESTION,
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text
    assert final.usage.cache_read_input_tokens > 0


def test_websocket_chat(server):
    with connect(server.url.replace("http", "ws") + "/v1/ws") as ws:
        ws.send(json.dumps({"type": "chat", "id": "1", "messages": QUESTION, "max_tokens": 6,
                            "temperature": 0}))
        frames = []
        while not frames or frames[-1]["type"] == "delta":
            frames.append(json.loads(ws.recv(timeout=120)))
    done = frames[-1]
    assert done["type"] == "done" and done["id"] == "1"
    assert done["usage"]["completion_tokens"] == sum(f["num_tokens"] for f in frames[:-1])
    assert "cached_tokens" in done["usage"] and done["timings"]["ttft_s"] > 0


def test_bad_input_and_metrics(server):
    response = requests.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    response = requests.post(server.url + "/v1/chat/completions", json={
        "messages": QUESTION, "chat_template": "{{ ''.__class__.__mro__ }}"})
    assert response.status_code == 400 and "error" in response.json()
    metrics = requests.get(server.url + "/metrics").text
    assert "duplex_generation_tokens_total" in metrics and "duplex_kv_blocks_total" in metrics


def _stream_until_end(url: str, body: dict, started: threading.Event, out: list) -> None:
    with requests.post(url, json=body, stream=True, timeout=120) as response:
        for line in response.iter_lines(decode_unicode=True):
            if line:
                out.append(line)
                started.set()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _cpu_used(pid: int, seconds: float) -> float:
    start = _cpu_seconds(pid)
    time.sleep(seconds)
    return _cpu_seconds(pid) - start


def test_client_disconnect_stops_the_work_on_the_worker(server):
    """Judged by the worker's CPU time: busy while the request streams, idle once the client
    is gone (the worker's heartbeat stats are only a snapshot taken between steps)."""
    [worker_pid] = server.worker_pids()
    body = {"messages": QUESTION, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True,
                       timeout=120) as response:
        lines = response.iter_lines()  # (dropping this iterator would close the connection)
        for _ in range(3):  # the role chunk, then tokens
            next(lines)
        busy = _cpu_used(worker_pid, 1.5)
    deadline = time.monotonic() + 10
    while requests.get(server.url + "/v1/status").json()["in_flight"] != 0:
        assert time.monotonic() < deadline, "the frontend kept the request"
        time.sleep(0.1)
    # the abort lands between steps; on a loaded machine a step can take a second or more
    deadline = time.monotonic() + 20
    while (idle := _cpu_used(worker_pid, 1.0)) > 0.05:
        assert time.monotonic() < deadline, f"the worker kept working: {idle:.2f} s/s"
    assert busy > 0.1, busy


def test_worker_sigkill_gives_one_terminal_error_per_stream_then_recovers(server):
    [worker_pid] = server.worker_pids()
    long_chat = {"messages": [{"role": "user", "content": "Write a long story about a cat."}],
                 "max_tokens": 1000, "ignore_eos": True, "stream": True}
    long_message = {"model": DEFAULT_MODEL_NAME, "max_tokens": 1000, "stream": True,
                    "ignore_eos": True, "messages": long_chat["messages"]}
    outputs, threads, started = [[], []], [], [threading.Event(), threading.Event()]
    for i, (path, body) in enumerate((("/v1/chat/completions", long_chat),
                                      ("/v1/messages", long_message))):
        threads.append(threading.Thread(target=_stream_until_end, args=(
            server.url + path, body, started[i], outputs[i])))
        threads[-1].start()
    for event in started:
        assert event.wait(120)
    time.sleep(0.5)
    os.kill(worker_pid, signal.SIGKILL)
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    openai_data = [line[6:] for line in outputs[0] if line.startswith("data: ")]
    assert openai_data[-1] == "[DONE]" and openai_data.count("[DONE]") == 1
    assert sum("error" in json.loads(d) for d in openai_data[:-1]) == 1
    assert "error" in json.loads(openai_data[-2])
    anthropic_events = [line[7:] for line in outputs[1] if line.startswith("event: ")]
    assert anthropic_events[-1] == "error" and anthropic_events.count("error") == 1
    assert "message_stop" not in anthropic_events
    server.wait_health(503, 10)
    server.wait_health(200, STARTUP_S)
    assert server.worker_pids() != [worker_pid]
    [worker] = requests.get(server.url + "/v1/status").json()["workers"]
    assert worker["restarts"] == 1 and "SIGKILL" in worker["last_exit"]
    reply = oai(server).chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION,
                                                max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_sigterm_drains_in_flight_requests_then_exits(server):
    out, started = [], threading.Event()
    body = {"messages": QUESTION, "max_tokens": 96, "ignore_eos": True, "stream": True}
    thread = threading.Thread(target=_stream_until_end, args=(
        server.url + "/v1/chat/completions", body, started, out))
    thread.start()
    assert started.wait(120)
    [worker_pid] = server.worker_pids()
    server.process.send_signal(signal.SIGTERM)
    server.wait_health(503, 10)
    response = requests.post(server.url + "/v1/chat/completions", json={"messages": QUESTION})
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    thread.join(150)
    data = [line[6:] for line in out if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and not any("error" in json.loads(d) for d in data[:-1])
    finishes = [c["finish_reason"] for d in data[:-1] for c in json.loads(d)["choices"]]
    assert "length" in finishes
    assert server.process.wait(150) == 0
    assert not Path(f"/proc/{worker_pid}").exists()  # the worker was stopped, and reaped
    # --log-format json: every line of the server's and its workers' log is one JSON object,
    # and the lines of one request share its id
    entries = [json.loads(line) for line in server.log_path.read_text().splitlines()]
    assert {"duplex.engine.worker", "duplex.serve"} <= {e["logger"] for e in entries}  # both processes
    http = [e for e in entries if e["msg"].startswith("http ") and "req_id" in e]
    assert http and all(f"req_id={e['req_id']}" in e["msg"] for e in http)
