"""One owner for dispatch (issue 36): `frontend/dispatcher.py` owns the flight table and the
router; `EngineClient` keeps the channel and worker liveness and holds none of that state.
Checked on the source, with a bad snippet for each check to show that it can fail."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DISPATCHER = "frontend/dispatcher.py"
# Names of state that belongs to the dispatcher; the client's attributes carry none of them.
DISPATCH_STATE = re.compile(r"router|flight|admission|reserv|gate|queue|pending", re.I)
DISPATCH_TYPES = {"Router", "Flight", "FlightTable", "WorkAdmission", "Admission", "FairGate"}


def router_methods() -> set[str]:
    tree = ast.parse((ROOT / "frontend/router.py").read_text())
    router = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Router")
    return {f.name for f in router.body
            if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}


def router_calls(source: str, methods: set[str]) -> list[str]:
    """`router.m(...)` / `<x>.router.m(...)` calls of a Router method, as text."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in methods:
            receiver = node.func.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else \
                getattr(receiver, "id", "")
            if name.lower().lstrip("_").endswith("router"):
                calls.append(ast.unparse(node))
    return calls


def flight_table_uses(source: str) -> list[str]:
    """Imports of the flight record or table (their only user is the dispatcher)."""
    return [f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names if alias.name in ("Flight", "FlightTable", "Flights")]


def client_state(source: str, class_name: str = "EngineClient") -> list[str]:
    """Attributes of the class that hold dispatch state: by name or by what builds them,
    and imports of the router, flight table or admission modules by its module."""
    tree = ast.parse(source)
    wrong = [f"import {node.module}" for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and node.module in (
                 "duplex.frontend.router", "duplex.frontend.admission")]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    for node in ast.walk(cls):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        built = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)} \
            if node.value is not None else set()
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                    and target.value.id == "self" and (DISPATCH_STATE.search(target.attr)
                                                       or built & DISPATCH_TYPES):
                wrong.append(ast.unparse(node))
    return wrong


def frontend_modules() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text()
            for path in sorted((ROOT / "frontend").rglob("*.py"))}


def test_only_the_dispatcher_calls_the_router():
    methods = router_methods()
    assert {"enqueue", "pop_ready", "prefill_done", "add_worker"} <= methods
    wrong = {path: calls for path, source in frontend_modules().items()
             if path != DISPATCHER and (calls := router_calls(source, methods))}
    assert not wrong, f"router calls outside {DISPATCHER}: {wrong}"
    assert router_calls((ROOT / DISPATCHER).read_text(), methods)  # the check sees its calls


def test_only_the_dispatcher_holds_the_flight_table():
    wrong = {path: uses for path, source in frontend_modules().items()
             if path != DISPATCHER and (uses := flight_table_uses(source))}
    assert not wrong, f"the flight table used outside {DISPATCHER}: {wrong}"


def test_engine_client_holds_no_dispatch_state():
    source = (ROOT / "frontend/engine_client.py").read_text()
    assert client_state(source) == []


def test_the_checks_fail_on_bad_snippets():
    methods = router_methods()
    assert router_calls("self.router.enqueue(msg)\nclient.dispatcher.router.pop_ready()\n"
                        "app.router.add_routes(r)\n", methods) == [
        "self.router.enqueue(msg)", "client.dispatcher.router.pop_ready()"]
    assert flight_table_uses("from duplex.frontend.dispatcher import FlightTable\n") == [
        "duplex.frontend.dispatcher.FlightTable"]
    bad_client = ("from duplex.frontend.router import Router\n"
                  "class EngineClient:\n"
                  "    def __init__(self, router):\n"
                  "        self.router = router\n"
                  "        self._table = FlightTable(router)\n"
                  "        self._workers = {}\n")
    assert client_state(bad_client) == ["import duplex.frontend.router",
                                        "self.router = router",
                                        "self._table = FlightTable(router)"]
