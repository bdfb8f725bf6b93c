"""`duplex serve` worker-layout flags: roles, buckets, policy; bad layouts exit 2 at once."""
from __future__ import annotations

from duplex.frontend.cli import build_parser
from duplex.frontend.serve import WorkerLayout, layout_from_args, normalize_args, run
from duplex.frontend.serve_config import serve_config_from_args
from duplex.frontend.supervisor import worker_config

from .conftest import engine_config


def parse(*argv: str):
    args = build_parser(only="serve").parse_args(["serve", *argv])
    normalize_args(args)
    return args


def test_default_is_one_unified_worker_with_buckets():
    layout = layout_from_args(parse())
    assert layout.roles == ("unified",) and layout.length_buckets == (512, 4096)
    assert layout.handoff_failure == "recompute"
    assert serve_config_from_args(parse()).engine.scheduler.fair_prefill


def test_split_layout_and_worker_flags():
    layout = layout_from_args(parse("--prefill-workers", "2", "--decode-workers", "1",
                                    "--length-buckets", "256,1024,8192", "--handoff-failure",
                                    "fail", "--handoff-lease-s", "3", "--no-fair-prefill",
                                    "--worker-bind", "tcp://127.0.0.1:5555"))
    assert layout.roles == ("prefill", "prefill", "decode")
    assert layout.length_buckets == (256, 1024, 8192) and layout.handoff_failure == "fail"
    assert layout.worker_bind == "tcp://127.0.0.1:5555"
    # the served-worker policy is the engine config's, which every worker receives as JSON
    engine = serve_config_from_args(parse("--prefill-workers", "2", "--decode-workers", "1",
                                          "--handoff-lease-s", "3", "--no-fair-prefill")).engine
    assert engine.worker.handoff_lease_s == 3.0 and not engine.scheduler.fair_prefill
    assert layout_from_args(parse("--length-buckets", "none")).length_buckets == ()


def test_bad_layouts_exit_2(capsys):
    assert run(parse("--prefill-workers", "1")) == 2
    assert "decode-workers" in capsys.readouterr().err
    assert run(parse("--prefill-workers", "1", "--decode-workers", "1",
                     "--length-buckets", "9,3")) == 2


def test_threads_are_split_between_workers(monkeypatch):
    monkeypatch.setattr("duplex.frontend.supervisor.available_cores", lambda: 8)
    config = engine_config(num_threads=0)
    assert worker_config(config, 3).num_threads == 2
    assert worker_config(config, 16).num_threads == 1
    assert worker_config(config, 1) is config
    assert worker_config(engine_config(num_threads=4), 2).num_threads == 4
    assert WorkerLayout().roles == ("unified",)
