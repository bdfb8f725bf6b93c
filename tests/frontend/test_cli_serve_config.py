"""The one serve config (frontend/serve_config.py): settings that nothing would read, or that
cannot work together, are refused at construction with a reason naming the flags (exit 2);
--print-config shows every DUPLEX_* switch; each worker receives the same one JSON config
and nothing else but which worker it is; the start-up banner follows --log-format."""
from __future__ import annotations

import json

import msgspec
import pytest

from duplex.engine.config import EngineConfig
from duplex.engine.worker_cli import add_arguments, check_cuda_graphs
from duplex.engine.worker_cli import _config_from as worker_config_from
from duplex.frontend import cli
from duplex.frontend.cli import build_parser
from duplex.frontend.serve import banner, normalize_args
from duplex.frontend.serve_config import ServeConfig, WorkerLayout, serve_config_from_args
from duplex.frontend.supervisor import Supervisor
from duplex.kernels import switches

# each combination that used to be accepted and then ignored, and the flags its reason names
REFUSED_BY_SERVE = {
    "cuda graphs on the CPU": (["--device", "cpu", "--cuda-graphs"],
                               ["--cuda-graphs", "--device"]),
    "cuda graphs with expert parallelism": (["--cuda-graphs", "--expert-parallel", "2"],
                                            ["--cuda-graphs", "--expert-parallel"]),
    "a draft model without draft speculation": (["--draft-model", "d.gguf", "--speculation",
                                                 "ngram"], ["--draft-model", "--speculation"]),
    "a disk tier size without a disk tier": (["--kv-disk-bytes", "1000000"],
                                             ["--kv-disk-bytes", "--kv-dir"]),
    "a shared tier size without a shared tier": (["--kv-remote-bytes", "1000000"],
                                                 ["--kv-remote-bytes", "--kv-remote"]),
    "a hand-off lease with a unified worker": (["--handoff-lease-s", "3"],
                                               ["--handoff-lease-s", "--prefill-workers"]),
    "int4 weights on a GPU": (["--dtype", "int4", "--device", "cuda"], ["--dtype int4", "cuda"]),
    "fair prefill in an expert-parallel group": (["--fair-prefill", "--expert-parallel", "2"],
                                                 ["--fair-prefill", "--expert-parallel"]),
    "expert parallelism with a split": (["--expert-parallel", "2", "--prefill-workers", "1",
                                         "--decode-workers", "1"],
                                        ["--expert-parallel", "--prefill-workers"]),
}
WORKER = ["worker", "--connect", "ipc:///nonexistent/duplex.ipc"]
REFUSED_BY_WORKER = {
    "a hand-off lease on a unified worker": (["--handoff-lease-s", "3"],
                                             ["--handoff-lease-s", "--role prefill"]),
    "a KV door on a prefill worker": (["--role", "prefill", "--kv-bind", "tcp://127.0.0.1:*"],
                                      ["--kv-bind", "--role decode"]),
    "engine flags beside --config-json": (["--config-json", "{}", "--block-size", "32"],
                                          ["--block-size", "--config-json"]),
}


def serve_args(*argv: str):
    args = build_parser(only="serve").parse_args(["serve", *argv])
    normalize_args(args)
    return args


@pytest.mark.parametrize("case", sorted(REFUSED_BY_SERVE))
def test_serve_refuses_a_setting_nothing_would_read(case, capsys):
    argv, named = REFUSED_BY_SERVE[case]
    assert cli.main(["serve", *argv]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert not out and len(lines) == 1 and lines[0].startswith("duplex serve: "), err
    for flag in named:
        assert flag in lines[0], (flag, lines[0])


@pytest.mark.parametrize("case", sorted(REFUSED_BY_WORKER))
def test_worker_refuses_a_flag_it_would_drop(case, capsys):
    argv, named = REFUSED_BY_WORKER[case]
    assert cli.main([*WORKER, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("duplex worker: ") and len(err.splitlines()) == 1, err
    for flag in named:
        assert flag in err, (flag, err)


def test_cuda_graphs_that_only_the_host_or_the_model_rule_out_are_refused(monkeypatch):
    """The worker's check before it connects (engine/worker_cli.check_model)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        check_cuda_graphs(EngineConfig.of(cuda_graphs=True), (None, None))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(ValueError, match="--cuda-graphs cannot run with hybrid KV.*--no-hybrid-kv"):
        check_cuda_graphs(EngineConfig.of(cuda_graphs=True), (None, 4096))
    check_cuda_graphs(EngineConfig.of(cuda_graphs=True, hybrid_kv=False), (None, 4096))
    check_cuda_graphs(EngineConfig.of(cuda_graphs=True), (None, None))


def test_each_setting_lives_in_one_field():
    config = serve_config_from_args(serve_args(
        "--prefill-workers", "1", "--decode-workers", "2", "--handoff-lease-s", "3",
        "--no-fair-prefill", "--log-format", "json"))
    assert config.engine.scheduler.fair_prefill is False
    assert config.engine.worker.handoff_lease_s == 3.0 and config.log_format == "json"
    assert config.engine.worker.switches == switches.current()
    assert {f.name for f in WorkerLayout.__dataclass_fields__.values()}.isdisjoint(
        {"fair_prefill", "handoff_lease_s", "worker_key"})
    with pytest.raises(ValueError, match="role stays unified"):
        ServeConfig(EngineConfig.of(role="decode"))


def test_print_config_shows_every_switch(capsys, monkeypatch):
    monkeypatch.setenv("DUPLEX_QGEMV", "0")
    assert cli.main(["serve", "--print-config"]) == 0
    out = capsys.readouterr().out.splitlines()
    for switch in switches.SWITCHES:
        line = next((x for x in out if x.startswith(f"# {switch.name} = ")), None)
        assert line is not None, switch.name
        assert switch.kind in line
    assert any(x.startswith('# DUPLEX_QGEMV = "0"  # env') for x in out)
    assert "fair_prefill = true  # default (--fair-prefill)" in out


def test_every_worker_receives_the_same_one_json_config_and_only_who_it_is():
    config = serve_config_from_args(serve_args(
        "--prefill-workers", "1", "--decode-workers", "1", "--handoff-lease-s", "3",
        "--no-fair-prefill", "--log-format", "json", "--num-threads", "1"))
    supervisor = Supervisor(config.engine, roles=config.layout.roles)
    identity = {"--role", "--connect", "--worker-id", "--parent-pid", "--startup-error-file"}
    sent = []
    for slot in supervisor._slots:
        command = supervisor._command(slot)
        assert command[1:3] == ["-m", "duplex.engine.worker_cli"]
        flags = command[3::2]
        assert flags.count("--config-json") == 1 and set(flags) - {"--config-json"} == identity
        sent.append(command[command.index("--config-json") + 1])
        parser = build_parser(only="worker").subcommands["worker"]
        worker = worker_config_from(parser.parse_args(command[3:]))
        assert worker == config.engine.replace(role=slot.role)
    assert sent[0] == sent[1]  # serialized once, the same for every worker
    assert msgspec.json.decode(sent[0], type=EngineConfig) == config.engine  # JSON, no pickle


def test_a_worker_by_hand_builds_the_same_policy_from_its_flags():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = worker_config_from(parser.parse_args(
        ["--role", "prefill", "--handoff-lease-s", "3", "--no-fair-prefill", "--log-format",
         "json"]))
    assert config.worker.role == "prefill" and config.worker.handoff_lease_s == 3.0
    assert not config.scheduler.fair_prefill and config.worker.log_format == "json"
    assert worker_config_from(parser.parse_args(["--expert-parallel", "2"])) \
        .scheduler.fair_prefill is False  # left out: off in an expert-parallel group


def test_the_banner_is_a_json_log_line_under_log_format_json():
    line = "Duplex is serving m at http://127.0.0.1:8000 (max_model_len=8, worker=unified)"
    assert banner(line, "text") == line
    entry = json.loads(banner(line, "json"))
    assert entry["msg"] == line and entry["level"] == "info" and entry["logger"] == "duplex.serve"


def test_a_served_worker_takes_its_servers_switches_over_its_environment(monkeypatch):
    monkeypatch.setattr(switches, "_applied", {})
    monkeypatch.setenv("DUPLEX_QGEMV", "1")
    switches.apply([("DUPLEX_QGEMV", "0")])
    assert switches.is_off("DUPLEX_QGEMV") and switches.source("DUPLEX_QGEMV") == "config"
    with pytest.raises(ValueError, match="unknown switches: DUPLEX_NOPE"):
        switches.apply([("DUPLEX_NOPE", "1")])


def test_the_engine_reads_duplex_variables_only_through_the_switch_table():
    """kernels/switches.py is the one reader; a new DUPLEX_* read elsewhere fails here."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    read = re.compile(r"""(environ(\.get)?\(|environ\[|getenv\()\s*["']DUPLEX_""")
    readers = sorted(str(path.relative_to(repo)) for folder in ("engine", "kernels", "kvstore")
                     for path in (repo / folder).rglob("*.py") if read.search(path.read_text()))
    assert readers == [], readers  # switches.py reads os.environ by each switch's name
    names = {s.name for s in switches.SWITCHES}
    assert len(names) == len(switches.SWITCHES) and all(n.startswith("DUPLEX_") for n in names)
