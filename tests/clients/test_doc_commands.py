"""Every command README.md and docs/ show a user is accounted for here, and run: the quick
start, the offline `duplex generate`, `duplex chat` piped, each example script against the
real default server, the settings commands (`--config`, `DUPLEX_*`, `--print-config`, a model
directory as MODEL). A benchmark command takes minutes, so its whole command line is parsed by
the real `duplex` parser (each benchmark runs on tiny shapes in tests/bench/); what needs
other hosts or a 12-minute build is listed with the reason. A command added to the docs and
not to one of these tables fails `test_every_documented_command_is_accounted_for`."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from client_support import REPO, RealServer, client_env
from doc_commands import documented_commands, fenced_blocks, inline_commands

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent  # this venv's `duplex`, `python`, `pytest`
FRANCE = 'duplex generate --chat --prompt "What is the capital of France?"'
BENCH_ALL = "duplex bench serve / offline / compare"

# ---------------------------------------------------------------- what is done with each
SKIPPED = {
    "make test": "the suite itself",
    "bash ../shared/anchors/build-llama-server.sh /tmp/llamacpp":
        "builds llama.cpp from source (~12 min on 2 cores); `duplex bench anchor` is tested "
        "with a stand-in server in tests/bench/test_bench_anchor.py",
    "cmake --build /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build --target "
    "llama-quantize": "adds llama-quantize to that build (seconds, but only after it)",
    "redis-server --bind 10.0.0.5 --port 6379 --save '' --maxmemory 64gb "
    "--maxmemory-policy volatile-lru":
        "binds another host's address; tests/kvstore runs a real redis-server on loopback",
    "git worktree add /tmp/wt-old c0eea3f && cp bench/sampler.py /tmp/wt-old/bench/":
        "a past measurement against an older commit",
    "(cd /tmp/wt-old && PYTHONPATH=. python -m bench.cli sampler --logits "
    "/tmp/bench/logits.pt --skip-ref)": "a past measurement against an older commit "
                                          "(that commit's module names)",
}
# run by the tests below, each against what it needs
RUN = {
    "make serve", "duplex --version", ".venv/bin/" + FRANCE,
    "curl -N http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' "
    "-d '{\"model\":\"SmolLM2-135M-Instruct\",\"stream\":true,\"messages\":[{\"role\":\"user\","
    "\"content\":\"Hi!\"}]}'",
    ".venv/bin/duplex chat", "duplex chat", 'echo "Why is the sky blue?" | duplex chat > answer.txt',
    "python examples/openai_chat.py", "python examples/anthropic_messages.py",
    "bash examples/curl_sse.sh", 'python examples/ws_client.py "a question"',
    'node examples/ws_client.mjs "a question"',
    "duplex serve ./models/Qwen2-0.5B --port 9000",
    "DUPLEX_PORT=9000 DUPLEX_API_KEY=k1,k2 duplex serve",
    "duplex serve --config duplex.toml", "duplex serve --config duplex.toml --print-config",
    "duplex keys duplex.key",
    "OMP_NUM_THREADS=1 bash bench/scripts/run_serving.sh",  # bash -n, and its commands parsed
    "pytest -m perf tests/web/test_web_render_perf.py -s",  # collected, not run (perf)
}


def parsed(commands: dict[str, str]) -> list[str]:
    """The rest: `duplex ...` command lines whose arguments the real parser must accept."""
    return [c for c in commands if c not in RUN and c not in SKIPPED]


def test_every_documented_command_is_accounted_for():
    commands = documented_commands(REPO)
    stale = (RUN | set(SKIPPED)) - set(commands)
    assert not stale, f"listed here but no longer in the docs: {sorted(stale)}"
    odd = [c for c in parsed(commands) if not re.match(r"(\w+=\S+ )*(duplex |for )", c)]
    assert not odd, f"documented commands with no test (add to RUN or SKIPPED): {odd}"


def test_the_extractor_joins_continuations_and_loops():
    from doc_commands import block_commands
    body = ("# a comment\nduplex serve --port 1 \\\n    --api-key k   # trailing\n"
            "for w in a b; do\n  duplex bench serve --workload $w\ndone\n")
    assert block_commands(body) == ["duplex serve --port 1 --api-key k",
                                    "for w in a b; do duplex bench serve --workload $w; done"]


# ---------------------------------------------------------------- parsed
def duplex_argvs(command: str) -> list[list[str]]:
    """The `duplex` argument lists of one documented command (a loop: one per value)."""
    loop = re.match(r"for (\w+) in (.+?); do (.+?); done$", command)
    if loop:
        name, values, body = loop.groups()
        return [a for v in values.split() for a in duplex_argvs(body.replace(f"${name}", v))]
    words = shlex.split(command.rstrip(" &"))
    while words and re.match(r"\w+=", words[0]):  # OMP_NUM_THREADS=1 ...
        words.pop(0)
    assert words[0] == "duplex", command
    return [words[1:]]


def parse_duplex(argv: list[str]) -> None:
    from duplex.frontend import cli

    command = argv[0]
    try:
        cli._parse(cli.build_parser(only=command), argv, command)
    except SystemExit as e:
        if e.code != 0:  # --help exits 0
            raise AssertionError(f"`duplex {shlex.join(argv)}` is refused by its parser") from e


# prose that names a flag of a command rather than giving a whole command line
FRAGMENTS = {"duplex plan --calibrate": "the flag of `duplex plan --workload FILE`",
             "duplex worker --connect": "the flag of `duplex worker --connect ADDRESS`"}


@pytest.mark.parametrize("command", sorted(set(inline_commands(REPO)) - set(FRAGMENTS)))
def test_inline_command_parses(command, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    parse_duplex(shlex.split(command.split(" > ")[0])[1:])


def test_fragments_are_still_in_the_docs():
    assert set(FRAGMENTS) <= set(inline_commands(REPO))


@pytest.mark.parametrize("command", parsed(documented_commands(REPO)))
def test_documented_command_parses(command, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for argv in duplex_argvs(command):
        parse_duplex(argv)


def test_run_serving_script_is_valid_bash_and_its_commands_parse():
    """bench/scripts/run_serving.sh: bash accepts it, and each `$DUPLEX ...` line, with its
    shell variables given sample values, is accepted by the real parser."""
    script = REPO / "bench/scripts/run_serving.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text().replace("\\\n", " ")
    common = re.search(r'local common="(.+?)"', text).group(1)
    values = {"$common": common, "$url": "http://127.0.0.1:1", '"$OUT': '"out',
              "$OUT": "out", "$name": "n", "$w": "w"}
    lines = re.findall(r"^\s*\$DUPLEX (.+)$", text, re.M)
    assert len(lines) >= 7, lines  # serve, 4 loads, baseline-server, compare
    for line in lines:
        line = re.sub(r"\s*(>\S+|2>&1|&)(?=\s|$)", "", line)
        for name, value in values.items():
            line = line.replace(name, value)
        assert "$" not in line, line
        parse_duplex(shlex.split(line))


def test_perf_command_collects_its_test():
    out = subprocess.run([str(BIN / "python"), "-m", "pytest", "--collect-only", "-q", "-m",
                          "perf", "tests/web/test_web_render_perf.py"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and re.search(r"\d+ tests? collected", out.stdout), out.stdout


# ---------------------------------------------------------------- run
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shell(command: str, cwd: Path, timeout: float = 180, stdin: str = "",
          **env: str) -> subprocess.CompletedProcess:
    """A documented command through bash, with this venv's bin first on PATH."""
    command = command.replace(".venv/bin/", f"{BIN}/")
    environ = client_env(PATH=f"{BIN}:{os.environ['PATH']}", OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=environ, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    # a short context bounds the answers of the commands that set no max_tokens (duplex chat)
    server = RealServer(tmp_path_factory.mktemp("log") / "serve.log", "--max-model-len", "320")
    try:
        server.wait_healthy(180)
        yield server
    finally:
        server.stop()


def test_duplex_version():
    out = shell("duplex --version", REPO)
    assert out.returncode == 0 and re.fullmatch(r"duplex \d+\.\d+\.\d+\n", out.stdout)


def test_generate_answers_paris():
    out = shell(".venv/bin/" + FRANCE, REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout, out.stdout


def test_curl_quick_start(real_server):
    command = next(c for c in RUN if c.startswith("curl -N"))
    out = shell(command.replace("127.0.0.1:8000", f"127.0.0.1:{real_server.port}"), REPO)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("data: [DONE]"), out.stdout


def test_chat_with_a_question_on_stdin(real_server):
    """`.venv/bin/duplex chat` and the table's `duplex chat` are one program (PATH has .venv/bin
    first here): run once, as a person at the prompt would type one question."""
    out = shell(".venv/bin/duplex chat", REPO,
                stdin="What is the capital of France? Answer in one word.\n",
                DUPLEX_URL=real_server.url)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() and "tokens" in out.stderr


def test_chat_piped_into_a_file(real_server, tmp_path):
    out = shell('echo "Why is the sky blue?" | duplex chat > answer.txt', tmp_path,
                DUPLEX_URL=real_server.url)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "answer.txt").read_text().strip()


@pytest.mark.parametrize("command, promises", [
    ("python examples/openai_chat.py", ["== chat ==", "== streaming ==", "== tools ==",
                                        "from the KV cache"]),
    ("python examples/anthropic_messages.py", ["== message ==", "== streaming ==",
                                               "cache_read_input_tokens"]),
    ("bash examples/curl_sse.sh", ["data: [DONE]", "event: message_stop"]),
    ('python examples/ws_client.py "a question"', ["(finish: "]),
    ('node examples/ws_client.mjs "a question"', ["(finish: "]),
])
def test_example_against_the_default_server(real_server, command, promises):
    if command.startswith("node"):
        if shutil.which("node") is None:
            pytest.skip("needs node")
        major = int(subprocess.check_output(["node", "--version"], text=True)[1:].split(".")[0])
        if major < 22:  # as the README says: Node 20 and 21 need the flag
            command = command.replace("node ", "node --experimental-websocket ")
    out = shell(command, REPO, DUPLEX_URL=real_server.url)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    for promise in promises:
        assert promise in out.stdout, out.stdout


class Served:
    """A documented long-running command (a server) in its own session: healthy, then
    stopped with its whole process group."""

    def __init__(self, command: str, cwd: Path, port: int, **env: str) -> None:
        # the log outside the checkout: a run must leave nothing in the repository
        self.port, self.log = port, Path(tempfile.gettempdir()) / f"duplex-served-{port}.log"
        environ = client_env(PATH=f"{BIN}:{os.environ['PATH']}", OMP_NUM_THREADS="1",
                             DUPLEX_NUM_THREADS="1", **env)
        self.process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=environ,
                                        stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def __enter__(self) -> "Served":
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            if self.status("/health") == 200:
                return self
            time.sleep(0.3)
        raise AssertionError(f"never healthy:\n{self.log.read_text()[-3000:]}")

    def __exit__(self, *_) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def status(self, path: str, key: str | None = None) -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}")
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0


def test_make_serve_quick_start(tmp_path):
    stamp = subprocess.run(["make", "-q", ".venv/.installed"], cwd=REPO)
    if stamp.returncode != 0 or Path(sys.executable).parent != REPO / ".venv" / "bin":
        pytest.skip("make serve would install .venv first (this run is not in it)")
    port = free_port()
    with Served(f"make serve PORT={port}", REPO, port) as served:
        assert served.status("/v1/models") == 200


def test_keys_command_writes_a_private_key(tmp_path):
    out = shell("duplex keys duplex.key", tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "duplex.key").stat().st_mode & 0o777 == 0o600


def test_multi_host_commands_refuse_an_open_address_without_the_key(tmp_path):
    """The README's multi-host lines carry --worker-key: without it the same serve line is
    refused at start-up (an address reachable from other hosts), as the Hardening notes say."""
    command = next(c for c in documented_commands(REPO) if "--worker-bind tcp://10.0.0.2" in c)
    assert "--worker-key duplex.key" in command
    bare = command.replace(" --worker-key duplex.key", "")
    local = (bare.replace("10.0.0.5:6379", "127.0.0.1:1")  # never another host's address
             .replace("10.0.0.2", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")
             .replace("127.0.0.1:5555", "0.0.0.0:5555"))  # an open bind, as the README's
    assert "10.0.0." not in local
    out = shell(local, tmp_path, timeout=120)
    assert out.returncode == 2 and "key" in out.stderr, out.stderr


def readme_toml() -> str:
    blocks = fenced_blocks((REPO / "README.md").read_text())
    return next(body for language, body in blocks if language == "toml")


def test_config_file_commands(tmp_path):
    port = free_port()
    (tmp_path / "duplex.toml").write_text(readme_toml().replace("port = 9000", f"port = {port}"))
    out = shell("duplex serve --config duplex.toml --print-config", tmp_path)
    assert out.returncode == 0, out.stderr
    assert re.search(rf"^port = {port}  # file\b", out.stdout, re.M), out.stdout
    with Served("duplex serve --config duplex.toml", tmp_path, port) as served:
        assert served.status("/v1/models") == 401  # api-key = ["k1"]
        assert served.status("/v1/models", key="k1") == 200


def test_environment_commands(tmp_path):
    port = free_port()
    with Served("duplex serve", tmp_path, port, DUPLEX_PORT=str(port),
                DUPLEX_API_KEY="k1,k2") as served:
        assert served.status("/v1/models", key="k2") == 200
        assert served.status("/v1/models") == 401


def test_model_directory_as_positional(tmp_path):
    """`duplex serve ./models/Qwen2-0.5B`: a Hugging Face directory by that name (a tiny
    random Qwen2 here: nothing is downloaded)."""
    import torch
    import transformers

    from tests.moe.conftest import VOCAB, add_word_tokenizer
    model_dir = tmp_path / "models" / "Qwen2-0.5B"
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    transformers.Qwen2ForCausalLM(config).save_pretrained(model_dir)
    add_word_tokenizer(model_dir)
    port = free_port()
    with Served(f"duplex serve ./models/Qwen2-0.5B --port {port}", tmp_path, port) as served:
        assert served.status("/v1/models") == 200
