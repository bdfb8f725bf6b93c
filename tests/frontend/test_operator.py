"""The operator's knobs, in process: settings from flags, DUPLEX_* variables and a config file
(precedence and --print-config), --version, `serve MODEL`, bench's help, CORS, TLS with a
self-signed certificate made here, and JSON logs with the request id on every line."""
from __future__ import annotations

import io
import json
import logging
import shutil
import ssl
import subprocess
import tomllib

import aiohttp
import pytest
from aiohttp import web
from frontend_fakes import FakeEngineClient, FakeRecipe

from duplex.frontend import cli, cli_config
from duplex.engine.logs import setup_logging
from duplex.frontend.operator_flags import tls_context
from duplex.frontend.serve import run
from duplex.frontend.server import AppState, ServerOptions, build_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def serve_parser():
    return cli.build_parser(only="serve").subcommands["serve"]


def parse(argv, environ=None):
    return cli_config.parse(serve_parser(), argv, environ or {})


def sources(args) -> dict[str, str]:
    return {s.dest: s.source for s in args.settings}


# ---------------------------------------------------------------- precedence
def test_cli_beats_env_beats_file_beats_default(tmp_path):
    config = tmp_path / "duplex.toml"
    config.write_text('port = 7000\nmax-n = 3\napi_key = ["f1", "f2"]\nlog_level = "debug"\n'
                      "fair_prefill = true\n")
    environ = {"DUPLEX_PORT": "9001", "DUPLEX_FAIR_PREFILL": "0", "DUPLEX_MAX_N": "6",
               "DUPLEX_CONFIG": str(config)}
    args = parse(["--max-n", "5"], environ)
    assert (args.max_n, args.port, args.fair_prefill) == (5, 9001, False)
    assert (args.api_key, args.log_level, args.host) == (["f1", "f2"], "debug", "127.0.0.1")
    got = sources(args)
    assert (got["max_n"], got["port"], got["fair_prefill"]) == ("cli", "env", "env")
    assert (got["api_key"], got["log_level"], got["host"]) == ("file", "file", "default")
    # a repeated flag from the environment: comma-separated; the flag's type applies
    args = parse(["--config", str(config)], {"DUPLEX_API_KEY": "e1,e2", "DUPLEX_PORT": "9002",
                                             "DUPLEX_DTYPE": "bfloat16"})  # vLLM's spelling
    assert args.api_key == ["e1", "e2"] and args.port == 9002 and args.config == str(config)
    assert args.weights_dtype == "bfloat16"
    # flags named the vLLM way and BooleanOptional switches on the command line
    args = parse(["--dtype", "float32", "--no-fair-prefill", "m.gguf"], environ)
    assert args.weights_dtype == "float32" and args.fair_prefill is False
    assert sources(args)["fair_prefill"] == "cli" and args.model_arg == "m.gguf"


def test_yaml_config(tmp_path):
    pytest.importorskip("yaml", reason="PyYAML missing: YAML config files need it")
    config = tmp_path / "duplex.yaml"
    config.write_text("port: 7100\nallowed-origins: [https://a.example]\nmetrics_public: true\n")
    args = parse(["--config", str(config)])
    assert (args.port, args.allowed_origins, args.metrics_public) == \
        (7100, ["https://a.example"], True)


@pytest.mark.parametrize("environ, text, message", [
    ({"DUPLEX_PORT": "eighty"}, "", "DUPLEX_PORT: bad value 'eighty' for --port"),
    ({"DUPLEX_LOG_LEVEL": "loud"}, "", "choose from debug, info"),
    ({"DUPLEX_METRICS_PUBLIC": "maybe"}, "", "expected true or false"),
    ({}, "prot = 1\n", "unknown settings: prot"),
    ({}, "port = [1, 2]\n", "expected a single value"),
    ({}, "port = \n", "cannot parse it"),
])
def test_bad_values_name_their_source(tmp_path, capsys, environ, text, message):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse(["--config", str(config)], environ)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_print_config_is_toml_that_reads_back(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DUPLEX_PORT", "9003")
    assert cli.main(["serve", "some/model.gguf", "--max-n", "2", "--api-key", "s3cret",
                     "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out
    lines = out.splitlines()
    assert "port = 9003  # env (DUPLEX_PORT)" in lines
    assert "max_n = 2  # cli (--max-n)" in lines
    assert 'model = "some/model.gguf"  # cli (MODEL)' in lines
    assert "block_size = 16  # default (--block-size)" in lines
    assert "# api_key = (1 value, hidden)  # cli (--api-key)" in lines
    values = tomllib.loads(out)
    assert "api_key" not in values
    config = tmp_path / "printed.toml"
    config.write_text(out)
    again = parse(["--config", str(config)])
    for name in ("port", "max_n", "model", "block_size", "length_buckets", "fair_prefill"):
        assert getattr(again, name) == values[name]


def test_version_positional_model_and_bench_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"duplex {cli.version()}"
    assert run(parse(["/nonexistent/a.gguf"])) == 2
    assert "/nonexistent/a.gguf" in capsys.readouterr().err
    assert run(parse(["a.gguf", "--model", "b.gguf"])) == 2
    assert "disagree" in capsys.readouterr().err
    from duplex.bench.cli import SUBCOMMANDS as BENCHMARKS
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"benchmarks: {', '.join(BENCHMARKS)}" in help_text


def test_allowed_origins_spellings():
    from duplex.frontend.operator_flags import parse_origins
    assert parse_origins(["https://a.example,https://b.example/", "http://c:8080"]) == \
        ("https://a.example", "https://b.example", "http://c:8080")
    assert parse_origins(['["*"]']) == ("*",)  # vLLM's JSON list
    with pytest.raises(ValueError, match="not a JSON list"):
        parse_origins(["[nope"])


def test_bad_operator_flags_exit_2(capsys, tmp_path):
    assert run(parse(["--allowed-origins", "example.com"])) == 2
    assert "not an origin" in capsys.readouterr().err
    assert run(parse(["--ssl-keyfile", str(tmp_path / "k.pem")])) == 2
    assert "needs --ssl-certfile" in capsys.readouterr().err
    assert run(parse(["--chat-template", str(tmp_path / "missing.jinja")])) == 2
    assert "missing.jinja" in capsys.readouterr().err


# ---------------------------------------------------------------- CORS
async def test_cors_preflight_and_headers(make_harness):
    h = await make_harness(api_keys=("k",), allowed_origins=("https://app.example",))
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    response = await h.client.options("/v1/chat/completions", headers=preflight)
    assert response.status == 204  # answered before the key check: preflights carry no key
    assert response.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "POST" in response.headers["Access-Control-Allow-Methods"]
    assert response.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    headers = {"Origin": "https://app.example", "Authorization": "Bearer k"}
    response = await h.post("/v1/chat/completions", {**CHAT, "stream": True}, headers=headers)
    assert response.status == 200 and "data:" in await response.text()  # SSE, streamed
    assert response.headers["Access-Control-Allow-Origin"] == "https://app.example"
    response = await h.post("/v1/chat/completions", CHAT, headers={"Origin": "https://app.example"})
    assert response.status == 401  # CORS is no way around the key; the error is readable
    assert response.headers["Access-Control-Allow-Origin"] == "https://app.example"
    other = {**preflight, "Origin": "https://evil.example"}
    response = await h.client.options("/v1/chat/completions", headers=other)
    assert "Access-Control-Allow-Origin" not in response.headers and response.status >= 400
    response = await h.client.get("/health", headers={"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in response.headers


async def test_no_cors_headers_by_default(harness):
    response = await harness.client.get("/health", headers={"Origin": "https://app.example"})
    assert "Access-Control-Allow-Origin" not in response.headers


# ---------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def self_signed(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is missing (apt-get install openssl)")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


async def test_tls_with_a_self_signed_certificate(self_signed, unused_tcp_port):
    cert, key = self_signed
    state = AppState(FakeEngineClient(), FakeRecipe(), ServerOptions())
    runner = web.AppRunner(build_app(state))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port,
                      ssl_context=tls_context(str(cert), str(key))).start()
    url = f"https://127.0.0.1:{unused_tcp_port}"
    try:
        trusted = ssl.create_default_context(cafile=str(cert))
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/chat/completions", json=CHAT, ssl=trusted) as r:
                assert r.status == 200 and (await r.json())["object"] == "chat.completion"
            async with session.ws_connect(f"wss://127.0.0.1:{unused_tcp_port}/v1/ws",
                                          ssl=trusted) as socket:
                await socket.send_json({"type": "ping"})
                assert (await socket.receive_json())["type"] == "pong"
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await session.get(f"{url}/health")  # not trusted by default: really TLS
            with pytest.raises(aiohttp.ClientError):
                await session.get(f"http://127.0.0.1:{unused_tcp_port}/health")
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------- logs
async def test_json_logs_carry_the_request_id_on_every_line(make_harness):
    inner = logging.getLogger("duplex.test.engine")

    def reply(msg):
        inner.info("engine saw a request req=%s", msg.req_id)  # inside the request's task
        return "hello"

    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    setup_logging("info", "json", stream)
    try:
        h = await make_harness(FakeEngineClient(reply=reply))
        for _ in range(2):
            assert (await h.post("/v1/chat/completions", CHAT)).status == 200
        logging.getLogger("duplex.test").warning("outside any request")
    finally:
        root.handlers[:], root.level = saved
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    ours = [e for e in entries if e["logger"].startswith("duplex")]
    assert all({"ts", "level", "logger", "msg"} <= set(e) for e in ours)
    engine_lines = [e for e in ours if e["logger"] == "duplex.test.engine"]
    http_lines = [e for e in ours if e["msg"].startswith("http ")]
    assert len(engine_lines) == len(http_lines) == 2
    for engine_line, http_line in zip(engine_lines, http_lines):
        assert engine_line["req_id"] == http_line["req_id"]
        assert f"req_id={http_line['req_id']}" in http_line["msg"]
    assert engine_lines[0]["req_id"] != engine_lines[1]["req_id"]
    assert "req_id" not in ours[-1] and ours[-1]["msg"] == "outside any request"


def test_drain_outcome_says_why_it_ended():
    from duplex.frontend.serve import drain_outcome
    assert drain_outcome(True, False, 0, 30) is None
    assert drain_outcome(False, True, 0, 30) is None  # a second signal after all finished
    assert drain_outcome(False, True, 2, 30) == \
        "a second signal cut the drain short; ending in-flight=2 with an error"
    assert drain_outcome(False, False, 1, 30) == \
        "the drain timeout of 30.0 s passed; ending in-flight=1 with an error"
