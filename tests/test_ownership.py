"""One owner per piece of state (DESIGN.md section 2), checked on the source and at run time.

The names checked are read off the owning types, not listed here:

* Request fields: every attribute `engine.request.Request` sets on itself. Only
  engine/request.py writes them (its transitions); any other module that can hold a Request
  (one in engine/, or one importing engine.request) writes none of them on any object:
  no assignment, augmented assignment, `del`, `setattr`, in-place call (`x.f.append(...)`),
  nor any of those through a local alias of a container field (`t = req.f; t[0] = ...`).
  ``self.f = ...`` inside another class is that class's own field (a drafter's RequestView),
  and an object whose parameter annotation names another type is not a Request
  (``record: logging.LogRecord``).
* Block tables: the per-request maps a KV manager keeps (`dict[str, ...]` attributes of
  KVCacheManager / HybridKVCacheManager) are touched only in engine/kv_manager.py and
  engine/hybrid_kv.py; others read them through the managers' methods and `tables`. At run
  time a Request driven through both managers' allocate / publish / trim / free keeps no
  reference to a manager's lists, and its fields move only through its transitions.
* Device KV blocks and their reference counts change only in engine/block_pool.py, and only
  the KV managers call the pool's mutating methods.
* The hand-off (engine/kv_transfer.py) reaches neither the core's requests nor the pool.

Each check is also fed bad source (or a rogue manager) to show it reports it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from duplex.engine.block_pool import BlockPool
from duplex.engine.hybrid_kv import HybridKVCacheManager, HybridLayout
from duplex.engine.kv_manager import KVCacheManager
from duplex.engine.request import Request
from duplex.engine.sampling_params import SamplingParams
from duplex.kvstore import keys as kvkeys

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("engine", "frontend", "bench", "kvstore")

REQUEST_OWNER = "engine/request.py"
KV_OWNERS = {"engine/kv_manager.py": "KVCacheManager", "engine/hybrid_kv.py":
             "HybridKVCacheManager"}

POOL_STATE = {"ref_cnt", "block_key", "key_to_block", "_free"}
POOL_OWNER = "engine/block_pool.py"
POOL_MUTATORS = {"allocate", "free", "touch", "publish", "evict_all_cached"}
POOL_USERS = {POOL_OWNER, *KV_OWNERS, "engine/spec/draft_model.py"}  # the draft's own pool
POOL_NAMES = {"pool", "swa_pool", "_pool"}  # how the code names a BlockPool


def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            out.append((rel, ast.parse(path.read_text(), filename=rel)))
    return out


MODULES = _modules()
TREES = dict(MODULES)


# ------------------------------------------------------------------ fields, read off the types
def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _own_fields(cls: ast.ClassDef) -> dict[str, ast.AST]:
    """Attributes the class sets on `self` in its methods: name -> annotation or value."""
    fields = {}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id == "self" and t.attr not in fields:
                    fields[t.attr] = getattr(node, "annotation", None) or node.value
    return fields


def _is_container(typed: ast.AST) -> bool:
    """A list, dict or set field, by its annotation or its first value."""
    if isinstance(typed, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp)):
        return True
    text = ast.unparse(typed)
    return text.split("[")[0].split("(")[0] in {"list", "dict", "set", "deque", "OrderedDict"}


def _is_by_request(typed: ast.AST) -> bool:
    """A map keyed by request id: `dict[str, ...]` (or OrderedDict)."""
    text = ast.unparse(typed).replace(" ", "")
    return text.startswith(("dict[str,", "OrderedDict[str,"))


REQUEST_FIELDS = _own_fields(_class(TREES[REQUEST_OWNER], "Request"))
REQUEST_CONTAINERS = {name for name, typed in REQUEST_FIELDS.items() if _is_container(typed)}
KV_TABLES = {name for rel, cls in KV_OWNERS.items()
             for name, typed in _own_fields(_class(TREES[rel], cls)).items()
             if _is_by_request(typed)}


def _sees_requests(rel: str, tree: ast.Module) -> bool:
    """Whether a module can hold a Request: it is in engine/ or imports engine.request."""
    return rel.startswith("engine/") or any(
        isinstance(n, ast.ImportFrom) and (n.module or "").endswith("engine.request")
        for n in ast.walk(tree))


# ------------------------------------------------------------------ the writes scan
class _Writes(ast.NodeVisitor):
    """(line, field) of every write to a field in `names` on an object other than `self`
    of the enclosing class: assignment, augmented assignment, `del x.f[...]`, `setattr`,
    in-place calls (`x.f.append(...)`), and the same through a local alias of a field in
    `containers` (`t = x.f` then `t[i] = ...`, `t += ...`, `t.extend(...)`, `del t[i]`)."""

    MUTATING_CALLS = {"append", "extend", "clear", "pop", "insert", "remove", "update",
                      "setdefault", "popitem", "add", "discard", "sort", "reverse"}

    def __init__(self, names: set[str], containers: set[str]) -> None:
        self.names, self.containers = names, containers
        self.found, self._class, self._aliases = [], [], [{}]
        self._typed: list[set[str]] = [set()]  # parameters annotated with another type

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._class.append(node.name)
        self.generic_visit(node)
        self._class.pop()

    def visit_FunctionDef(self, node) -> None:
        self._aliases.append({})  # aliases are local to a function
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        self._typed.append({a.arg for a in args if a.annotation is not None
                            and "Request" not in ast.unparse(a.annotation)})
        self.generic_visit(node)
        self._aliases.pop()
        self._typed.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _target(self, node: ast.AST, lineno: int, rebinds: bool = False) -> None:
        is_item = isinstance(node, ast.Subscript)
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, (ast.Tuple, ast.List, ast.Starred)):
            for elt in node.elts if not isinstance(node, ast.Starred) else [node.value]:
                self._target(elt, lineno, rebinds)
        elif isinstance(node, ast.Attribute) and node.attr in self.names:
            base = node.value.id if isinstance(node.value, ast.Name) else None
            is_own = base == "self" and self._class
            if not is_own and base not in self._typed[-1]:
                self.found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in self._aliases[-1]:
            if is_item or not rebinds:  # `t[i] = ...`, `t += ...`: the field itself changes
                self.found.append((lineno, self._aliases[-1][node.id]))
            else:  # `t = ...`: t no longer names the field
                del self._aliases[-1][node.id]

    def _alias(self, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name) and isinstance(value, ast.Attribute) \
                and value.attr in self.containers:
            is_own = isinstance(value.value, ast.Name) and value.value.id == "self" \
                and self._class
            if not is_own:
                self._aliases[-1][target.id] = value.attr

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self._target(target, node.lineno, rebinds=True)
            self._alias(target, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self._target(node.target, node.lineno, rebinds=True)
        if node.value is not None:
            self._alias(node.target, node.value)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target, node.lineno)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._target(target, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in self.MUTATING_CALLS:
            self._target(func.value, node.lineno)
        is_setattr = isinstance(func, ast.Name) and func.id == "setattr" and len(node.args) > 1
        if is_setattr and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in self.names:
            self.found.append((node.lineno, node.args[1].value))
        self.generic_visit(node)


def _writes(tree: ast.Module, names: set[str], containers: set[str] = frozenset()
            ) -> list[tuple[int, str]]:
    visitor = _Writes(names, containers)
    visitor.visit(tree)
    return visitor.found


def _request_writes(tree: ast.Module) -> list[tuple[int, str]]:
    return _writes(tree, set(REQUEST_FIELDS), REQUEST_CONTAINERS)


def _table_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, attribute) of every use of a KV manager's per-request map, read or write, on
    anything but `self` (a class's own map of the same name is its own: the draft model's)."""
    return sorted((node.lineno, node.attr) for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in KV_TABLES
                  and not (isinstance(node.value, ast.Name) and node.value.id == "self"))


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


# ------------------------------------------------------------------ the tree
def test_the_scan_sees_the_tree_and_the_types():
    assert {REQUEST_OWNER, POOL_OWNER, *KV_OWNERS, "engine/core.py", "engine/kv_transfer.py",
            "bench/spec.py"} <= set(TREES)
    assert {"num_computed_tokens", "spec_token_ids", "output_token_ids", "status",
            "finish_reason", "replay_end", "num_pending"} <= set(REQUEST_FIELDS)
    assert {"output_token_ids", "spec_token_ids", "cached_tokens_by_tier"} <= \
        REQUEST_CONTAINERS and "num_computed_tokens" not in REQUEST_CONTAINERS
    assert {"req_to_blocks", "req_to_keys", "num_published", "req_to_swa_blocks"} <= KV_TABLES
    assert _sees_requests("bench/spec.py", TREES["bench/spec.py"])
    assert not _sees_requests("frontend/router.py", TREES["frontend/router.py"])


REQUEST_SCANNED = [m for m in MODULES if m[0] != REQUEST_OWNER and _sees_requests(*m)]


@pytest.mark.parametrize("rel, tree", REQUEST_SCANNED, ids=[m[0] for m in REQUEST_SCANNED])
def test_only_request_py_writes_request_fields(rel, tree):
    assert _request_writes(tree) == [], \
        f"{rel} writes Request fields; call a Request transition instead"


TABLE_SCANNED = [m for m in MODULES if m[0] not in KV_OWNERS]


@pytest.mark.parametrize("rel, tree", TABLE_SCANNED, ids=[m[0] for m in TABLE_SCANNED])
def test_only_the_kv_managers_hold_block_tables(rel, tree):
    assert _table_uses(tree) == [], \
        f"{rel} reaches into a KV manager's per-request maps; ask the manager"


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
    tree = TREES["engine/kv_transfer.py"]
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & {"requests", "pool", "ref_cnt", "tiers", "_core"}


# ------------------------------------------------------------------ at run time
BS = 4


def _kv_managers() -> list[KVCacheManager]:
    ns = kvkeys.namespace("m", "f", BS)
    plain = KVCacheManager(BlockPool(32), BS, lambda salt: ns)
    layout = HybridLayout.plan([None, 8], 32, BS, max_num_seqs=2, max_num_batched_tokens=8)
    hybrid = HybridKVCacheManager(BlockPool(layout.num_full_blocks),
                                  BlockPool(layout.num_swa_blocks), layout, BS, lambda salt: ns)
    return [plain, hybrid]


def _fields(req: Request) -> dict:
    """A Request's fields, containers copied (to see in-place changes)."""
    return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
            for k, v in vars(req).items()}


def _lifecycle_leaks(kv: KVCacheManager) -> list[str]:
    """Drive a request through kv as the engine does (prefix hit, steps, a trim, free) and
    report what the manager did to it besides its transitions: a field it changed, or a
    list of its own the request refers to."""
    leaks = []

    def check(req: Request, before: dict, where: str) -> None:
        after = _fields(req)
        leaks.extend(f"{where}: {k}" for k in after if after[k] != before.get(k, object()))
        held = {id(v) for m in (kv.req_to_blocks, kv.req_to_keys,
                                getattr(kv, "req_to_swa_blocks", {})) for v in m.values()}
        leaks.extend(f"{where}: {k} is the manager's" for k, v in vars(req).items()
                     if id(v) in held)

    first = Request("a", list(range(13)), SamplingParams(max_tokens=8), ())
    before = _fields(first)
    assert kv.allocate_slots(first, first.num_tokens)
    check(first, before, "allocate")
    first.advance(first.num_tokens)
    before = _fields(first)
    kv.publish(first)
    check(first, before, "publish")
    second = Request("b", list(range(12)) + [99], SamplingParams(max_tokens=8), ())
    hit = kv.find_cached_blocks(second)
    assert hit, "the second request shares the first one's prefix"
    restore = kv.restore_point(second, len(hit), 0)
    num_new = second.num_tokens - restore.num_computed
    before = _fields(second)
    assert kv.allocate_slots(second, num_new, hit)
    check(second, before, "allocate after a hit")
    second.restore_prefix(*restore)
    second.advance(num_new)
    kv.publish(second)
    second.add_token(7)
    second.set_drafts([1, 2, 3])
    assert kv.allocate_slots(second, 4)
    second.advance(5)
    second.add_token(8)
    second.rollback()
    before = _fields(second)
    kv.trim(second)
    kv.publish(second)
    check(second, before, "trim and publish")
    for req in (first, second):
        before = _fields(req)
        kv.free(req)
        check(req, before, "free")
    return leaks


@pytest.mark.parametrize("kv", _kv_managers(), ids=["plain", "hybrid"])
def test_the_kv_managers_leave_requests_to_their_transitions(kv):
    assert _lifecycle_leaks(kv) == []
    assert kv.pool.num_used_blocks == 0 and not kv.req_to_blocks and not kv.req_to_keys


# ------------------------------------------------------------------ the checks themselves
@pytest.mark.parametrize("source, expected", [
    ("req.num_computed_tokens = 3", [(1, "num_computed_tokens")]),
    ("req.num_computed_tokens += 1", [(1, "num_computed_tokens")]),
    ("a.b.spec_token_ids = []", [(1, "spec_token_ids")]),
    ("del req.spec_token_ids[2:]", [(1, "spec_token_ids")]),
    ("req.spec_token_ids.append(5)", [(1, "spec_token_ids")]),
    ("x, req.status = 1, 2", [(1, "status")]),
    ("req.finish_reason = 'stop'", [(1, "finish_reason")]),
    ("setattr(req, 'num_computed_tokens', 0)", [(1, "num_computed_tokens")]),
    ("def f(self):\n    self.num_computed_tokens = 0", [(2, "num_computed_tokens")]),
    ("class View:\n    def __init__(self):\n        self.num_computed_tokens = 0", []),
    ("n = req.num_computed_tokens + len(req.spec_token_ids)", []),
    ("def f(req: Request):\n    req.status = 1", [(2, "status")]),
    ("def f(record: logging.LogRecord):\n    record.req_id = 1", []),  # another type
    # through an alias of a container field
    ("def f(req):\n    t = req.output_token_ids\n    t[0] = 1", [(3, "output_token_ids")]),
    ("def f(req):\n    t = req.spec_token_ids\n    t += [1]", [(3, "spec_token_ids")]),
    ("def f(req):\n    t = req.spec_token_ids\n    t.extend([1])", [(3, "spec_token_ids")]),
    ("def f(req):\n    t = req.cached_tokens_by_tier\n    del t['x']",
     [(3, "cached_tokens_by_tier")]),
    ("def f(req):\n    t = req.output_token_ids\n    t = []\n    t.append(1)", []),
    ("def f(req):\n    n = req.num_computed_tokens\n    n += 1", []),  # an int: a copy
    ("def f(req):\n    t = req.output_token_ids\ndef g(t):\n    t.append(1)", []),
])
def test_the_request_check_finds_writes(source, expected):
    assert _request_writes(ast.parse(source)) == expected


@pytest.mark.parametrize("source, expected", [
    ("core.kv.req_to_blocks[r] = [1]", [(1, "req_to_blocks")]),
    ("ids = kv.req_to_swa_blocks.get(r)", [(1, "req_to_swa_blocks")]),
    ("kv.num_published.pop(r)", [(1, "num_published")]),
    ("class Draft:\n    def f(self):\n        self.req_to_blocks = {}", []),
    ("ids = kv.block_ids(r)", []),
])
def test_the_table_check_finds_uses(source, expected):
    assert _table_uses(ast.parse(source)) == expected


def test_the_sees_requests_check_follows_the_import():
    assert _sees_requests("bench/x.py", ast.parse("from duplex.engine.request import Request"))
    assert not _sees_requests("bench/x.py", ast.parse("from duplex.engine import messages"))


class _RogueKV(KVCacheManager):
    """Puts its table on the request and moves its progress, as the old code did."""

    def allocate_slots(self, req, num_new_tokens, hit_block_ids=None, loaded=()):
        ok = super().allocate_slots(req, num_new_tokens, hit_block_ids, loaded)
        req.block_ids = self.req_to_blocks.get(req.req_id)
        if hit_block_ids:
            req.num_computed_tokens = len(hit_block_ids) * self.block_size
        return ok


def test_the_run_time_check_finds_a_rogue_manager():
    ns = kvkeys.namespace("m", "f", BS)
    leaks = _lifecycle_leaks(_RogueKV(BlockPool(32), BS, lambda salt: ns))
    assert "allocate: block_ids" in leaks and "allocate: block_ids is the manager's" in leaks
    assert "allocate after a hit: num_computed_tokens" in leaks


@pytest.mark.parametrize("source, expected", [
    ("self._core.pool.free(ids)", [(1, "free")]),
    ("pool.touch([b])", [(1, "touch")]),
    ("self.kv.free(req)", []),
    ("self.pool.lookup(key)", []),
])
def test_the_lint_finds_pool_calls(source, expected):
    assert _pool_calls(ast.parse(source)) == expected
