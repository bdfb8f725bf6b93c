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


OLD_NAMES = {"engine", "frontend", "kvstore", "kernels", "bench"}


def imported_modules(tree: ast.AST) -> set[str]:
    """Every absolutely imported module's dotted name."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def imported_packages(tree: ast.AST) -> set[str]:
    """Duplex's subpackage (`engine` for `duplex.engine.core`) of every import of ours."""
    return {name.split(".")[1] for name in imported_modules(tree)
            if name.startswith("duplex.") and name.count(".") >= 1}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_above_it(package):
    wrong = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_packages(ast.parse(path.read_text())) & FORBIDDEN[package]
        if bad:
            wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert not wrong, f"imports against DESIGN.md's direction: {wrong}"


def test_the_check_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from duplex.frontend.recipe import Recipe\n"
                     "import duplex.bench.cli\nimport kernels\n")
    assert imported_packages(tree) == {"frontend", "bench"}


def test_nothing_imports_an_old_top_level_name():
    """One import namespace: `duplex.kernels`, never `kernels` (which is Hugging Face's)."""
    wrong = {}
    for folder in ("duplex", *sorted(OLD_NAMES), "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if folder == "duplex" and path.parent != ROOT / "duplex":
                continue  # the links: the same files under their own folders
            old = {m for m in imported_modules(ast.parse(path.read_text()))
                   if m.split(".")[0] in OLD_NAMES}
            if old:
                wrong[str(path.relative_to(ROOT))] = sorted(old)
    assert not wrong, f"imports of the pre-namespace names: {wrong}"
