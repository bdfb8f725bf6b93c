"""`duplex generate`: every flag its parser offers either works (an answer on stdout) or is
refused in one plain line with exit status 2 — never a traceback. The flags that work run in a
few groups of compatible values (one model load each); a flag added to the parser and not to
a group here fails `test_every_flag_is_in_one_group`."""
from __future__ import annotations

import pytest

from duplex.engine.config import default_model_path
from duplex.frontend import cli

BASE = ["generate", "--prompt", "Hi", "--max-tokens", "2", "--num-threads", "1"]
# each group: a non-default value for every flag in it ({model}: the default GGUF; {tmp}: a
# fresh directory); they run together and must work together
WORKS: dict[str, list[str]] = {
    "sampling": ["--prompt", "Hello", "--chat", "--system", "Be brief.", "--max-tokens", "3",
                 "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--gen-seed", "1",
                 "--stop", ".", "--ignore-eos"],
    "model": ["--model", "{model}", "--max-model-len", "256", "--dtype", "float32", "--seed",
              "3", "--device", "cpu", "--gpu-memory-utilization", "0.5", "--no-cuda-graphs",
              "--overlap", "on", "--no-batch-invariant", "--num-threads", "1",
              "--no-enable-prefix-caching"],
    "scheduler and tiers": ["--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                            "--step-budget-ms", "50", "--block-size", "8", "--kv-cache-bytes",
                            "8388608", "--kv-cache-dtype", "float32",
                            "--no-hybrid-kv", "--kv-dir",
                            "{tmp}/disk", "--kv-host-bytes", "1000000", "--kv-disk-bytes",
                            "1000000", "--chat-ttl-s", "60", "--agent-ttl-s", "60"],
    "pool and shared tier": ["--num-kv-blocks", "64", "--enable-prefix-caching", "--hybrid-kv",
                             "--kv-remote", "{tmp}/shared", "--kv-remote-bytes", "1000000",
                             "--batch-invariant", "--weights-dtype", "bfloat16",
                             "--cuda-graphs"],
    "speculation": ["--speculation", "ngram", "--num-draft-tokens", "2", "--no-spec-confidence",
                    "--spec-token-cost", "0.5", "--spec-draft-layers", "1"],
    "speculation with the head": ["--speculation", "ngram", "--spec-confidence",
                                  "--spec-token-cost", "0.5"],
    "expert parallel, one rank": ["--ep-redundant-experts", "1", "--eplb-interval-steps", "5",
                                  "--ep-master", "127.0.0.1:29999", "--ep-local-ranks", "1"],
}
# flags refused offline, each with a value that triggers the refusal
REFUSED: dict[str, list[str]] = {
    "--expert-parallel": ["--expert-parallel", "2"],  # a group of processes: serve / worker
    "--draft-model": ["--draft-model", "{model}"],  # read by --speculation draft only
}


def option_strings() -> set[str]:
    parser = cli.build_parser(only="generate").subcommands["generate"]
    return {s for action in parser._actions for s in action.option_strings} - {"-h", "--help"}


def test_every_flag_is_in_one_group():
    grouped = {w for argv in WORKS.values() for w in argv if w.startswith("--")} | set(REFUSED)
    assert grouped == option_strings()


def generate(argv: list[str], tmp_path, capsys) -> tuple[int, str, str]:
    argv = [a.format(model=default_model_path(), tmp=tmp_path) for a in argv]
    rc = cli.main([*BASE, *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("group", sorted(WORKS))
def test_flags_work(group, tmp_path, capsys):
    rc, out, err = generate(WORKS[group], tmp_path, capsys)
    assert rc == 0, err[-3000:]
    assert out.strip() and "finish_reason=" in err


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_flag_is_refused_in_one_plain_line(flag, tmp_path, capsys):
    rc, out, err = generate(REFUSED[flag], tmp_path, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and not out and len(lines) == 1, err
    assert lines[0].startswith("duplex generate: ") and flag in lines[0]
