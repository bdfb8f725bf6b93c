"""`duplex serve` flags and start-up validation (nothing is started)."""
from __future__ import annotations

from duplex.frontend.cli import build_parser
from duplex.frontend.serve import model_name, run


def parse(*argv: str):
    return build_parser(only="serve").parse_args(["serve", *argv])


def test_defaults_bind_localhost():
    args = parse()
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert args.api_key == [] and args.served_model_name == []
    assert (args.max_queued_requests, args.max_n) == (256, 8)
    assert args.shutdown_timeout > 0 and args.request_timeout > 0
    assert args.model is None and args.block_size == 16  # the engine's own flags


def test_repeatable_flags():
    args = parse("--api-key", "a", "--api-key", "b", "--served-model-name", "x",
                 "--served-model-name", "y", "--max-queued-requests", "3", "--log-level",
                 "debug")
    assert args.api_key == ["a", "b"] and args.served_model_name == ["x", "y"]
    assert args.max_queued_requests == 3 and args.log_level == "debug"


def test_bad_configuration_exits_2_before_starting(capsys):
    assert run(parse("--block-size", "7")) == 2
    assert "block_size" in capsys.readouterr().err
    assert run(parse("--model", "/nonexistent/model.gguf")) == 2
    assert run(parse("--max-n", "0")) == 2


def test_model_name():
    assert model_name(None) == "SmolLM2-135M-Instruct"
    assert model_name("/models/tiny-llama.Q4_0.gguf") == "tiny-llama.Q4_0"
    assert model_name("/models/Qwen2-0.5B/") == "Qwen2-0.5B"
