"""The shape of the source (issue 18): no class with more than 20 methods, no function over 60
lines, a median function of at most 8 lines, over engine/, frontend/, kvstore/ and kernels/.

Exempt from the length limit: the `__init__` of model classes (engine/models/: one line per
weight, built bottom-up) and triton kernels (`@triton.jit`: one compiled unit, which cannot
call a helper that is not itself a kernel). Methods count properties and dunders alike.
"""
from __future__ import annotations

import ast
import functools
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "frontend", "kvstore", "kernels")
MAX_METHODS = 20
MAX_LINES = 60
MAX_MEDIAN_LINES = 8

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


@functools.cache
def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path)))
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def _functions(tree: ast.Module):
    """(function node, enclosing class or None) for every function, nested ones too."""
    owners = {id(child): node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
              for child in node.body}
    return [(node, owners.get(id(node))) for node in ast.walk(tree)
            if isinstance(node, _FUNCTIONS)]


def _is_exempt(path: str, node, owner) -> bool:
    is_model_init = path.startswith("engine/models/") and owner is not None and \
        node.name == "__init__"
    return is_model_init or any("jit" in ast.unparse(d) for d in node.decorator_list)


def _lines(node) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_class_has_more_than_20_methods():
    big = [f"{path}: {node.name} has {n} methods"
           for path, tree in _modules() for node in ast.walk(tree)
           if isinstance(node, ast.ClassDef)
           and (n := sum(isinstance(b, _FUNCTIONS) for b in node.body)) > MAX_METHODS]
    assert not big, "split these by responsibility:\n" + "\n".join(big)


def test_functions_are_short():
    lengths, long = [], []
    for path, tree in _modules():
        for node, owner in _functions(tree):
            lengths.append(_lines(node))
            if _lines(node) > MAX_LINES and not _is_exempt(path, node, owner):
                long.append(f"{path}:{node.lineno} {node.name}: {_lines(node)} lines")
    assert not long, f"functions over {MAX_LINES} lines:\n" + "\n".join(long)
    median = statistics.median(lengths)
    assert median <= MAX_MEDIAN_LINES, f"median function length {median} > {MAX_MEDIAN_LINES}"
