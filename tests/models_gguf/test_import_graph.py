"""engine/models imports form no cycle (deferred imports inside functions included), and
engine/models/args.py, which every model and loader depends on, is a leaf."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[2] / "engine" / "models"
PACKAGE = "duplex.engine.models"


def imported_modules(path: Path) -> set[str]:
    """Every `duplex.*` module the file imports, at any depth (functions, TYPE_CHECKING)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("duplex.")}


def model_graph() -> dict[str, set[str]]:
    """module stem -> the engine/models modules it imports."""
    stems = {p.stem for p in MODELS.glob("*.py") if p.stem != "__init__"}
    return {stem: {n.split(".")[3] for n in imported_modules(MODELS / f"{stem}.py")
                   if n.startswith(PACKAGE + ".") and n.split(".")[3] in stems}
            for stem in stems}


def test_args_is_a_leaf():
    assert imported_modules(MODELS / "args.py") == set()


def test_no_import_cycle_among_models():
    graph = model_graph()
    done: set[str] = set()

    def visit(stem: str, path: tuple[str, ...]) -> None:
        assert stem not in path, f"import cycle: {' -> '.join(path + (stem,))}"
        if stem not in done:
            for dep in sorted(graph[stem]):
                visit(dep, path + (stem,))
            done.add(stem)

    for stem in sorted(graph):
        visit(stem, ())
    assert "args" in graph["loader"] and "loader" not in graph["llama"]


@pytest.mark.parametrize("module", ["moe"])  # moe -> llama -> loader -> moe was the cycle
def test_module_imports_first_in_a_fresh_interpreter(module):
    code = f"import {PACKAGE}.{module}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
