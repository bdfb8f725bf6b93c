"""One owner per piece of state (DESIGN.md section 2), checked on the source: an AST scan of
engine/, frontend/, bench/ and kvstore/ that fails when a module writes state it does not own.

* A request's progress counters change only through `engine.request.Request` transitions:
  no other module assigns, augments or deletes from them on any object (``self.x = ...``
  inside another class is that class's own field, e.g. a drafter's RequestView).
* Device KV blocks and their reference counts change only in engine/block_pool.py, and only
  the KV managers call the pool's mutating methods.
* The hand-off (engine/kv_transfer.py) reaches neither the core's requests nor the pool.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("engine", "frontend", "bench", "kvstore")

REQUEST_COUNTERS = {"num_computed_tokens", "spec_token_ids", "num_preemptions",
                    "num_draft_proposed", "num_draft_accepted", "num_cached_tokens",
                    "cached_tokens_by_tier", "scheduled_time", "replay_end", "num_pending"}
REQUEST_STATUS = {"status"}  # a common word: checked in engine/ only (bench records have one)
REQUEST_OWNER = "engine/request.py"

POOL_STATE = {"ref_cnt", "block_key", "key_to_block", "_free"}
POOL_OWNER = "engine/block_pool.py"
POOL_MUTATORS = {"allocate", "free", "touch", "publish", "evict_all_cached"}
POOL_USERS = {POOL_OWNER, "engine/kv_manager.py", "engine/hybrid_kv.py",
              "engine/spec/draft_model.py"}  # the draft model's own pool, not the target's
POOL_NAMES = {"pool", "swa_pool", "_pool"}  # how the code names a BlockPool


def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            out.append((rel, ast.parse(path.read_text(), filename=rel)))
    return out


MODULES = _modules()


class _Writes(ast.NodeVisitor):
    """(line, attribute) of every write to an attribute in `names` on an object other than
    `self` of the enclosing class: assignment, augmented assignment, `del x.attr[...]`, and
    in-place list calls (`x.attr.append(...)`)."""

    MUTATING_CALLS = {"append", "extend", "clear", "pop", "insert", "remove"}

    def __init__(self, names: set[str]) -> None:
        self.names, self.found, self._class = names, [], []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._class.append(node.name)
        self.generic_visit(node)
        self._class.pop()

    def _target(self, node: ast.AST) -> None:
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                self._target(elt)
        elif isinstance(node, ast.Attribute) and node.attr in self.names:
            is_own = isinstance(node.value, ast.Name) and node.value.id == "self" \
                and self._class
            if not is_own:
                self.found.append((node.lineno, node.attr))

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._target(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._target(target)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in self.MUTATING_CALLS:
            self._target(func.value)
        self.generic_visit(node)


def _writes(tree: ast.Module, names: set[str]) -> list[tuple[int, str]]:
    visitor = _Writes(names)
    visitor.visit(tree)
    return visitor.found


def _pool_calls(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, method) of mutating BlockPool calls: `<...>.pool.free(...)` and the like."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in POOL_MUTATORS:
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else \
                owner.id if isinstance(owner, ast.Name) else None
            if name in POOL_NAMES:
                found.append((node.lineno, node.func.attr))
    return found


def test_the_scan_sees_the_tree():
    names = {rel for rel, _ in MODULES}
    assert {REQUEST_OWNER, POOL_OWNER, "engine/core.py", "engine/kv_transfer.py",
            "bench/spec.py"} <= names


@pytest.mark.parametrize("rel, tree", [m for m in MODULES if m[0] != REQUEST_OWNER],
                         ids=[m[0] for m in MODULES if m[0] != REQUEST_OWNER])
def test_only_request_py_writes_request_counters(rel, tree):
    names = REQUEST_COUNTERS | (REQUEST_STATUS if rel.startswith("engine/") else set())
    assert _writes(tree, names) == [], \
        f"{rel} writes Request counters; call a Request transition instead"


@pytest.mark.parametrize("rel, tree", [m for m in MODULES if m[0] != POOL_OWNER],
                         ids=[m[0] for m in MODULES if m[0] != POOL_OWNER])
def test_only_block_pool_py_writes_ref_counts(rel, tree):
    assert _writes(tree, POOL_STATE) == [], \
        f"{rel} writes block pool state; only engine/block_pool.py may"


@pytest.mark.parametrize("rel, tree", [m for m in MODULES if m[0] not in POOL_USERS],
                         ids=[m[0] for m in MODULES if m[0] not in POOL_USERS])
def test_only_kv_managers_allocate_or_free_blocks(rel, tree):
    assert _pool_calls(tree) == [], \
        f"{rel} allocates, frees or pins blocks itself; use KVCacheManager's leases"


def test_the_hand_off_reaches_neither_requests_nor_the_pool():
    tree = dict(MODULES)["engine/kv_transfer.py"]
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & {"requests", "pool", "ref_cnt", "tiers", "_core"}


# ------------------------------------------------------------------ the lint itself
@pytest.mark.parametrize("source, expected", [
    ("req.num_computed_tokens = 3", [(1, "num_computed_tokens")]),
    ("req.num_computed_tokens += 1", [(1, "num_computed_tokens")]),
    ("a.b.spec_token_ids = []", [(1, "spec_token_ids")]),
    ("del req.spec_token_ids[2:]", [(1, "spec_token_ids")]),
    ("req.spec_token_ids.append(5)", [(1, "spec_token_ids")]),
    ("x, req.status = 1, 2", [(1, "status")]),
    ("def f(self):\n    self.num_computed_tokens = 0", [(2, "num_computed_tokens")]),
    ("class View:\n    def __init__(self):\n        self.num_computed_tokens = 0", []),
    ("n = req.num_computed_tokens + len(req.spec_token_ids)", []),
])
def test_the_lint_finds_writes(source, expected):
    assert _writes(ast.parse(source), REQUEST_COUNTERS | REQUEST_STATUS) == expected


@pytest.mark.parametrize("source, expected", [
    ("self._core.pool.free(ids)", [(1, "free")]),
    ("pool.touch([b])", [(1, "touch")]),
    ("self.kv.free(req)", []),
    ("self.pool.lookup(key)", []),
])
def test_the_lint_finds_pool_calls(source, expected):
    assert _pool_calls(ast.parse(source)) == expected
