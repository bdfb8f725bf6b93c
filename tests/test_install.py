"""Duplex installs as one import name, `duplex`, and works beside the ecosystem: with Hugging
Face's `kernels` installed (transformers imports it), `import duplex` and `duplex serve` work
from the repository root and from any other directory, with the editable install this venv
has and with a built wheel installed into a fresh venv. The wheel's only top-level name is
`duplex`, and no site-packages entry is named after a folder of the repository."""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "frontend", "kvstore", "kernels", "bench")

pytestmark = pytest.mark.slow

# Run in a child interpreter: where `duplex` and `kernels` come from, and a tokenizer load
# (the call that failed while Duplex's kernels/ shadowed Hugging Face's).
PROBE = """
import json, kernels, duplex, duplex.engine.core, duplex.frontend.server
from duplex.engine.config import default_model_path
from duplex.engine.text.recipe import Recipe
ids = Recipe.from_model(default_model_path()).encode_prompt("The capital of France is")
print(json.dumps({"duplex": duplex.__file__, "kernels": kernels.__file__,
                  "hf_kernels": hasattr(kernels, "get_kernel"), "ids": len(ids)}))
"""


def probe(python: str, cwd: Path) -> dict:
    out = subprocess.run([python, "-c", PROBE], cwd=cwd, capture_output=True, text=True,
                         timeout=120, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    (path,) = out.glob("duplex-*.whl")
    return path


@pytest.fixture(scope="module")
def wheel_venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding the wheel alone; its dependencies are this venv's (a path line in
    a .pth file: this venv's own .pth files, the editable finder among them, do not run)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "-q", "--no-deps", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    purelib = Path(subprocess.check_output(
        [str(venv / "bin" / "python"), "-c",
         "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_the_wheel_has_one_top_level_name(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"duplex"}
    for folder in FOLDERS:  # each folder's code is in the wheel under the one name
        assert any(n.startswith(f"duplex/{folder}/") and n.endswith(".py") for n in names)
    assert "duplex/web/index.html" in names and "duplex/kernels/cpu_qgemv.c" in names
    assert "duplex/frontend/templates/smollm2_tools.jinja" in names


def test_site_packages_has_no_entry_named_after_a_repo_folder(wheel_venv):
    purelib = next((wheel_venv / "lib").glob("python3*/site-packages"))
    assert {p.name for p in purelib.iterdir()} - {"deps.pth", "__pycache__"} == \
        {"duplex", "duplex-0.1.0.dist-info"}
    here = Path(sysconfig.get_paths()["purelib"])  # this venv: the editable install
    for folder in FOLDERS:
        entry = here / folder
        if folder == "kernels" and entry.exists():  # Hugging Face's, with its own metadata
            assert list(here.glob("kernels-*.dist-info")), "a kernels/ with no distribution"
            assert not (entry / "cpu_qgemv.c").exists()
        else:
            assert not entry.exists(), f"site-packages/{folder} exists"


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_editable_install_imports_beside_hf_kernels(where, tmp_path):
    result = probe(sys.executable, ROOT if where == "root" else tmp_path)
    assert result["hf_kernels"], f"`import kernels` found {result['kernels']}"
    assert Path(result["duplex"]).resolve() == (ROOT / "duplex" / "__init__.py").resolve()
    assert result["ids"] > 0


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_wheel_install_imports_beside_hf_kernels(wheel_venv, where, tmp_path):
    result = probe(str(wheel_venv / "bin" / "python"), ROOT if where == "root" else tmp_path)
    assert result["hf_kernels"], f"`import kernels` found {result['kernels']}"
    # from the root the checkout's duplex/ (the same files) comes first on sys.path
    expected = ROOT if where == "root" else wheel_venv
    assert Path(result["duplex"]).resolve().is_relative_to(expected.resolve())
    assert result["ids"] > 0


def serve_and_ask(duplex_bin: Path, cwd: Path, port: int) -> str:
    proc = subprocess.Popen([str(duplex_bin), "serve", "--port", str(port), "--num-threads",
                             "1", "--max-model-len", "512"], cwd=cwd, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(proc, port)
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hi!"}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                         data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"duplex serve exited {proc.returncode}: "
                                 f"{proc.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError("duplex serve never became healthy")


@pytest.mark.parametrize("install, where", [("editable", "elsewhere"), ("wheel", "elsewhere")])
def test_duplex_serve_answers(install, where, request, tmp_path, unused_tcp_port):
    """(The editable install from the root is what every other end-to-end test runs; the
    wheel from the root imports the checkout's files, test_wheel_install_imports_...)"""
    bin_dir = Path(sys.executable).parent if install == "editable" else \
        request.getfixturevalue("wheel_venv") / "bin"
    assert serve_and_ask(bin_dir / "duplex", ROOT if where == "root" else tmp_path,
                         unused_tcp_port)


def test_site_module_sees_this_venv():
    """The fixture's .pth trick rests on this venv's purelib being a site dir of this one."""
    assert sysconfig.get_paths()["purelib"] in site.getsitepackages()
