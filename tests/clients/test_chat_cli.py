"""`duplex chat` as people and scripts use it: through a pseudo-terminal and through a pipe,
against a fake-engine server on a real port. Also its pure helpers."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from client_support import REPO, FakeEngineClient, Terminal, client_env
from frontend_fakes import OFFSET

from duplex.frontend.chat import Answer, parse_params, read_message, stats_line, ws_url
from duplex.frontend.protocol import WsDone, WsTimings, WsUsage

CHAT = [sys.executable, "-m", "duplex.frontend.cli", "chat"]
LONG = "long " * 200  # 1000 tokens: seconds to stream at the step times used here


def prompt_text(msg) -> str:
    return bytes(i - OFFSET for i in msg.prompt_token_ids if i >= OFFSET).decode()


def describe_prompt(msg) -> str:
    """A reply that shows what the server got: turns, system prompt, the last user text."""
    text = prompt_text(msg)
    last = text.rsplit("<user>", 1)[1].removesuffix("\n<assistant>")
    system = text.split("<system>", 1)[1].split("\n", 1)[0] if "<system>" in text else None
    return f"users={text.count('<user>')} system={system!r} last={last!r}."


def long_unless_again(msg) -> str:
    return "short answer." if "again" in prompt_text(msg).rsplit("<user>", 1)[1] else LONG


def pipe(server_url: str, stdin: str, *flags: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CHAT, "--url", server_url, *flags], input=stdin, text=True,
                          capture_output=True, cwd=REPO, env=client_env(**env), timeout=60)


@pytest.fixture
def terminal():
    opened: list[Terminal] = []

    def open_terminal(server_url: str, *flags: str) -> Terminal:
        opened.append(Terminal([*CHAT, "--url", server_url, *flags], client_env()))
        opened[-1].expect(">>> ")
        return opened[-1]

    yield open_terminal
    for t in opened:
        t.close()


def assert_one_line_error(stderr: str, *words: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("duplex chat: "), stderr
    assert "Traceback" not in stderr and all(w in lines[0] for w in words), stderr


# ================================================================ through a terminal
def test_terminal_streams_answers_with_stats_and_commands(make_server, terminal):
    server = make_server(FakeEngineClient(reply=describe_prompt, num_cached=7, draft=(4, 3)))
    t = terminal(server.ws_url, "--system", "be brief")
    t.send("hello\r")
    t.expect(r"users=1 system='be brief' last='hello'\.\n")
    stats = t.expect(r"\[ttft \d+ ms, [\d.]+ tokens/s, (\d+) tokens, 7/\d+ prompt tokens cached, "
                     r"draft (\d+)/(\d+) accepted \(75%\)\]")
    num_tokens = int(stats[1])
    assert (int(stats[2]), int(stats[3])) == (3 * num_tokens, 4 * num_tokens)
    t.expect(">>> ")
    t.send("line one\\\r")  # a trailing backslash continues the message
    t.expect(r"\.\.\. ")
    t.send("line two\r")
    t.expect(r"users=2 system='be brief' last='line one\\nline two'\.")
    t.send('"""\rblock a\rblock b\r"""\r')
    t.expect(r"users=3 system='be brief' last='block a\\nblock b'\.")
    t.send("\x1b[200~pasted 1\npasted 2\x1b[201~\r")  # a bracketed paste is one message
    t.expect(r"users=4 system='be brief' last='pasted 1\\npasted 2'\.")
    t.send("/system be kind\r")
    t.expect(r"\(system prompt: 'be kind'\)")
    t.send("/reset\r")
    t.expect(r"\(conversation cleared\)")
    t.send("hi\r")
    t.expect(r"users=1 system='be kind' last='hi'\.")
    t.send("/params max_tokens=5 temperature=0.5\r")
    t.expect(r'\(params: \{"max_tokens": 5, "temperature": 0.5\}\)')
    t.send("hi\r")
    t.expect(r"\n(users)\n\[ttft .*, 5 tokens, .*finish: length\]")
    assert server.engine.added[-1].params.temperature == 0.5
    t.send("/params colour=red\r")
    t.expect(r"/params: expected NAME=VALUE, NAME one of: max_tokens, temperature")
    t.send("/params top_k=[1]\r")
    t.expect(r"/params: Expected `int \| null`, got `array` at 'top_k'")
    t.send("/nope\r")
    t.expect(r"unknown command /nope; /help lists the commands")
    t.send("/quit\r")
    assert t.wait() == 0


def test_ctrl_c_cancels_the_answer_and_the_next_prompt_works(make_server, terminal):
    server = make_server(FakeEngineClient(reply=long_unless_again, step_s=0.02))
    t = terminal(server.ws_url)
    t.send("tell me\r")
    t.expect("long long ")
    t.send("\x03")
    t.expect(r"\[cancelled\]\n>>> ")
    deadline = time.monotonic() + 5
    while not server.engine.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server.engine.aborted) == 1 and not server.engine.active  # freed on the engine
    t.send("again\r")
    t.expect(r"short answer\.\n\[ttft .*\]\n>>> ")
    time.sleep(0.3)  # a SIGINT before readline waits for keys is only seen at the next key
    t.send("\x03")  # at the prompt: leave
    assert t.wait() == 0
    assert "Traceback" not in t.text


def test_ctrl_d_at_the_prompt_leaves(server, terminal):
    t = terminal(server.ws_url)
    t.send("\x04")
    assert t.wait() == 0


def test_server_restart_mid_answer_reconnects_and_retries(make_server, terminal):
    server = make_server(FakeEngineClient(reply=LONG, step_s=0.02))
    t = terminal(server.ws_url, "--reconnect-timeout", "3")
    t.send("tell me\r")
    t.expect("long long ")
    server.stop()
    time.sleep(0.3)
    server.engine.reply = "after the restart."
    server.start()
    t.expect(r"the server is shutting down; retrying \(1/2\)\n")
    t.expect(r"after the restart\.\n\[ttft .*\]\n>>> ")
    server.stop()  # now for good: the next question says so and the program ends
    t.send("more\r")
    t.expect(r"duplex chat: cannot connect to ws://.*: connection refused .*gave up "
             r"reconnecting after 3 s")
    assert t.wait() == 1


def test_server_down_at_start_in_a_terminal(unused_port, terminal):
    t = Terminal([*CHAT, "--url", f"ws://127.0.0.1:{unused_port}/v1/ws"], client_env())
    try:
        assert t.wait() == 1
        assert "duplex chat: cannot connect" in t.text and "Traceback" not in t.text
    finally:
        t.close()


# ================================================================ through a pipe
def test_pipe_prints_only_the_answer_and_stats_on_stderr(make_server):
    server = make_server(FakeEngineClient(reply=describe_prompt))
    result = pipe(server.ws_url, "first line\nsecond line\n", "--max-tokens", "200",
                  "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "users=1 system=None last='first line\\nsecond line'.\n"
    assert result.stderr.startswith("[ttft ") and result.stderr.count("\n") == 1
    params = server.engine.added[0].params
    assert params.max_tokens == 200 and params.temperature == 0


def test_pipe_accepts_an_http_url_and_no_stats(server):
    result = pipe(server.url, "hi", "--no-stats")
    assert (result.returncode, result.stdout, result.stderr) == (0, "Hello there, friend!\n", "")


def test_pipe_server_down_is_one_line_and_exit_1(unused_port):
    result = pipe(f"ws://127.0.0.1:{unused_port}/v1/ws", "hi")
    assert result.returncode == 1 and result.stdout == ""
    assert_one_line_error(result.stderr, "cannot connect", "connection refused")


def test_pipe_bad_key_is_one_line_and_exit_1(make_server):
    server = make_server(api_keys=("right-key",))
    result = pipe(server.ws_url, "hi", "--api-key", "wrong-key")
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "rejected the API key", "401")
    ok = pipe(server.ws_url, "hi", "--no-stats", DUPLEX_API_KEY="right-key")
    assert (ok.returncode, ok.stdout) == (0, "Hello there, friend!\n")


def test_pipe_server_gone_mid_answer_is_one_line_and_exit_1(make_server):
    server = make_server(FakeEngineClient(reply=LONG, step_s=0.02))
    process = subprocess.Popen([*CHAT, "--url", server.ws_url], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=REPO, env=client_env())
    process.stdin.write("tell me")
    process.stdin.close()
    assert process.stdout.read(10) == "long long "
    server.stop()
    assert process.wait(30) == 1
    rest = process.stdout.read()  # what came before the loss, then a final newline
    assert rest.endswith("\n") and set(rest.split()) <= {"long"}
    assert_one_line_error(process.stderr.read(), "the server is shutting down")


def test_pipe_request_error_is_one_line(server):
    result = pipe(server.ws_url, "x" * 600)  # the fake model's context is 512 tokens
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "(invalid_request)", "context length")


def test_usage_errors_exit_2(server):
    assert pipe(server.ws_url, "   \n").returncode == 2  # nothing to ask
    result = pipe("ftp://example", "hi")
    assert result.returncode == 2 and "not a WebSocket URL" in result.stderr


# ================================================================ helpers
def test_ws_url_accepts_what_people_type():
    assert ws_url("ws://h:1/v1/ws") == "ws://h:1/v1/ws"
    assert ws_url("http://h:1") == "ws://h:1/v1/ws"
    assert ws_url("https://h/") == "wss://h/v1/ws"
    assert ws_url("h:8000") == "ws://h:8000/v1/ws"
    with pytest.raises(ValueError):
        ws_url("ftp://h")


def test_parse_params_validates_with_the_protocol_types():
    assert parse_params(["temperature=0.7", "stop=[\"a\",\"b\"]", "cache_salt=x"], {}) == {
        "temperature": 0.7, "stop": ["a", "b"], "cache_salt": "x"}
    assert parse_params(["temperature=none"], {"temperature": 1, "top_k": 5}) == {"top_k": 5}
    for bad in (["temperature"], ["bogus=1"], ["max_tokens=1.5"], ["retention=forever"]):
        with pytest.raises(ValueError):
            parse_params(bad, {})


def test_read_message_joins_continued_lines_and_blocks():
    def lines(*typed):
        it = iter(typed)
        return lambda prompt: next(it)
    assert read_message(lines("one")) == "one"
    assert read_message(lines("a\\", "b\\", "c")) == "a\nb\nc"
    assert read_message(lines('"""', "x", "", "y\\", '"""')) == "x\n\ny\\"


def test_stats_line():
    done = WsDone("1", "length", WsUsage(100, 20, 120, 64, {"device": 64}),
                  WsTimings(0.0421, 55.55, 0.4), batch_invariant=False)
    assert stats_line(Answer("", done, 10, 7)) == (
        "[ttft 42 ms, 55.5 tokens/s, 20 tokens, 64/100 prompt tokens cached, "
        "draft 7/10 accepted (70%), finish: length]")
    done.finish_reason = "stop"
    assert stats_line(Answer("", done, 0, 0)).endswith("cached, no speculation]")


def test_chat_does_not_import_torch():
    code = "import sys, duplex.frontend.cli as c; c.build_parser(only='chat'); " \
           "import duplex.frontend.chat; " \
           "assert 'torch' not in sys.modules and 'duplex.engine' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=client_env())
