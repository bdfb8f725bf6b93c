"""A GGUF file Duplex cannot run fails `LLM(...)`, `duplex generate` and `duplex serve` at
start-up with one line naming the file and the reason, and a non-zero exit code; `duplex
serve` exits instead of restarting its worker forever (frontend/supervisor.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from duplex.engine.models.args import ModelLoadError

REPO = Path(__file__).resolve().parents[2]
KINDS = ["unknown_arch", "no_quant_path", "truncated", "bad_magic", "bad_shape",
         "missing_tensor"]
READ_BY_THE_FRONTEND = ("truncated", "bad_magic")  # not a GGUF: refused before any worker
# Every kind goes through LLM(...) in-process (the loader check all entry points share); the
# commands are subprocesses of a few seconds each, so they run one kind per exit path: a
# file that is no GGUF (refused by the frontend) and one a worker refuses.
CLI_KINDS = ["bad_magic", "unknown_arch", "bad_shape"]
# `duplex serve`: one file per exit path. The worker-refused one is bad_shape, whose
# tokenizer (the default model's, on a llama file) the frontend reads from its cache; an
# unknown architecture's tokenizer is converted afresh on every start (it is never cached),
# which only added ~10 s before the same worker refusal.
SERVE_KINDS = ["bad_magic", "bad_shape"]
# generous for two busy cores; a restart loop never ends (the backoff caps at 10 s)
SERVE_EXIT_S = 240


def reason(kind: str, path: str) -> str:
    from tests.models_gguf.conftest import BAD_FILES

    return f"{path}: {BAD_FILES[kind].format(size=os.path.getsize(path))}"


def run_cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "duplex.frontend.cli", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=SERVE_EXIT_S + 60)
    return done, time.monotonic() - start


@pytest.mark.parametrize("kind", KINDS)
def test_llm_refuses_the_file(bad_file, kind):
    from duplex.engine.llm import LLM

    path = bad_file(kind)
    with pytest.raises(ModelLoadError) as error:
        LLM(model=path)
    assert str(error.value) == reason(kind, path)


@pytest.mark.parametrize("kind", CLI_KINDS)
def test_generate_exits_with_one_line(bad_file, kind):
    path = bad_file(kind)
    done, _ = run_cli("generate", "--model", path, "--prompt", "hi", "--max-tokens", "2")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"duplex generate: {reason(kind, path)}"]


@pytest.mark.parametrize("kind", SERVE_KINDS)
def test_serve_exits_with_the_workers_reason_instead_of_restarting(bad_file, kind):
    path = bad_file(kind)
    done, elapsed = run_cli("serve", "--model", path, "--port", "0", "--log-level", "warning")
    lines = [line for line in done.stderr.splitlines() if line.startswith("duplex serve:")]
    if kind in READ_BY_THE_FRONTEND:
        assert (done.returncode, lines) == (2, [f"duplex serve: {reason(kind, path)}"])
    else:
        assert (done.returncode, lines) == (
            1, [f"duplex serve: worker unified-0: {reason(kind, path)}"])
        assert done.stderr.count("started worker") <= 1 and "restart" not in done.stderr
    assert elapsed < SERVE_EXIT_S
