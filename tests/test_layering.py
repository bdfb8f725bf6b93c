"""DESIGN.md's dependency direction, checked on the source: `kernels/` and `kvstore/` import
nothing of ours above them, `engine/` imports nothing of `frontend/` or `bench/` (at module
level or inside a function)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"kernels": {"engine", "frontend", "bench", "kvstore"},
             "kvstore": {"engine", "frontend", "bench", "kernels"},
             "engine": {"frontend", "bench"}}


def imported_packages(tree: ast.AST) -> set[str]:
    """Top-level package of every absolute import in a module."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_above_it(package):
    wrong = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_packages(ast.parse(path.read_text())) & FORBIDDEN[package]
        if bad:
            wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert not wrong, f"imports against DESIGN.md's direction: {wrong}"


def test_the_check_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from frontend.recipe import Recipe\nimport bench.cli\n")
    assert imported_packages(tree) == {"frontend", "bench"}
