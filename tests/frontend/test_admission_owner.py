"""One owner for admission (issue 36): `frontend/admission.py` alone refuses a request for
the server's state (draining, no worker ready, the request count, the work bound) and alone
holds the counts and the fair gate. `AppState` builds the one `Admission`, the intake asks it
for a ticket and reserves the work, and the pipeline only takes and ends turns through the
reservation it is handed. Checked on the source; each check is a function of a source string,
and `test_the_checks_fail_on_bad_snippets` shows that each can fail."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ADMISSION = "frontend/admission.py"
BUILDER = "frontend/app_state.py"  # builds the one Admission
INTAKE = "frontend/intake.py"  # asks for tickets and reserves the work
REFUSAL_KINDS = {"overloaded", "unavailable"}  # ApiError kinds of draining/not ready/full
REFUSAL_CODES = {"overloaded", "request_too_large"}
REASONS = {"draining", "overloaded", "not_ready", "too_large"}  # duplex_requests_rejected
# receivers that are admission's objects; the last name of `gate` is the fair gate
OWNED = re.compile(r"(admission|ticket|reservation)$", re.I)
GATE = re.compile(r"(^|[._])gate$", re.I)


def _called(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _text(node: ast.AST) -> str:
    return ast.unparse(node).lower()


def refusals(source: str) -> list[str]:
    """Calls that make an admission refusal: `ApiError("overloaded" | "unavailable", ...)`,
    a refusal's code (`invalid(..., code="request_too_large")`, `code="overloaded"`), or a
    count of `rejected` with an admission reason."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        first = node.args[0] if node.args else None
        kind = first.value if isinstance(first, ast.Constant) else None
        codes = {k.value.value for k in node.keywords if k.arg == "code"
                 and isinstance(k.value, ast.Constant)}
        counted = (_called(node) == "labels" and isinstance(node.func, ast.Attribute)
                   and _text(node.func.value).endswith("rejected") and kind in REASONS)
        if (_called(node) == "ApiError" and kind in REFUSAL_KINDS) or codes & REFUSAL_CODES \
                or counted:
            found.append(ast.unparse(node))
    return found


def internals(source: str) -> list[str]:
    """Touches of admission's state: a private attribute of, or a write to, an admission,
    ticket or reservation; anything of the fair gate; building or importing a `FairGate`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "duplex.frontend.admission":
            found += [f"import {alias.name}" for alias in node.names if alias.name == "FairGate"]
        elif isinstance(node, ast.Attribute):
            receiver = _text(node.value)
            if (OWNED.search(receiver) and (node.attr.startswith("_")
                                            or isinstance(node.ctx, (ast.Store, ast.Del)))) \
                    or GATE.search(receiver) or node.attr in ("gate", "_gate"):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Call) and _called(node) == "FairGate":
            found.append(ast.unparse(node))
    return found


def builds_admission(source: str) -> list[str]:
    """`Admission.from_options(...)` / `Admission(...)`: only AppState builds the one."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and (_called(node) == "Admission" or (
                _called(node) == "from_options" and _text(node.func.value) == "admission"))]


def admits(source: str) -> list[str]:
    """Asks for a ticket (`<...>admission.admit()`) or reserves work (`<...>.reserve(...)`):
    the intake's part, once per API request."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and (node.func.attr == "reserve" or (node.func.attr == "admit"
                                                 and _text(node.func.value).endswith("admission")))]


def frontend_modules() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text()
            for path in sorted((ROOT / "frontend").rglob("*.py"))}


def test_only_admission_refuses():
    wrong = {path: calls for path, source in frontend_modules().items()
             if path != ADMISSION and (calls := refusals(source))}
    assert not wrong, f"admission refusals outside {ADMISSION}: {wrong}"
    source = (ROOT / ADMISSION).read_text()
    made = refusals(source)  # the check sees every one there: draining and not ready (503),
    assert len(made) == 6, made  # the request count and the work bound (429), too large (400)
    counted = {node.args[0].value for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Call) and _called(node) == "_refuse"}
    assert counted == REASONS  # each counted in duplex_requests_rejected by its reason


def test_no_module_touches_the_counts_or_the_gate():
    wrong = {path: touches for path, source in frontend_modules().items()
             if path != ADMISSION and (touches := internals(source))}
    assert not wrong, f"admission's state touched outside {ADMISSION}: {wrong}"


def test_app_state_builds_the_one_admission_and_the_intake_alone_admits():
    modules = frontend_modules()
    built = {path: calls for path, source in modules.items() if path != ADMISSION
             and (calls := builds_admission(source))}
    assert list(built) == [BUILDER] and len(built[BUILDER]) == 1, built
    asked = {path: calls for path, source in modules.items() if path != ADMISSION
             and (calls := admits(source))}
    assert list(asked) == [INTAKE] and len(asked[INTAKE]) == 2, asked  # admit, reserve


def test_the_checks_fail_on_bad_snippets():
    bad_refusals = (
        "if state.admission.draining:\n"
        "    state.metrics.rejected.labels('draining').inc()\n"
        "    raise ApiError('unavailable', 'the server is shutting down')\n"
        "raise ApiError('overloaded', 'full', code='overloaded')\n"
        "raise invalid('too big', param='n', code='request_too_large')\n"
        "raise ApiError('not_found', 'no such model')\n"  # not admission's: passes
        "raise ApiError(kind, final.message)\n")  # a failed stream's kind: passes
    assert sorted(refusals(bad_refusals)) == sorted([
        "state.metrics.rejected.labels('draining')",
        "ApiError('unavailable', 'the server is shutting down')",
        "ApiError('overloaded', 'full', code='overloaded')",
        "invalid('too big', param='n', code='request_too_large')"])
    bad_internals = (
        "from duplex.frontend.admission import FairGate, Reservation\n"
        "state.admission.draining = True\n"
        "self.state.admission._num_active += 1\n"
        "await reservation._owner._gate.acquire(tenant, 0)\n"
        "self.gate.release()\n"
        "gate = FairGate(4)\n"
        "n = state.admission.num_active\n"  # reading the public figures: passes
        "self._release()\n")  # another object's private method: passes
    assert sorted(internals(bad_internals)) == sorted([
        "import FairGate",
        "state.admission.draining",
        "self.state.admission._num_active",
        "reservation._owner._gate.acquire",
        "reservation._owner._gate",
        "reservation._owner",
        "self.gate.release",
        "self.gate",
        "FairGate(4)"])
    assert builds_admission("a = Admission.from_options(o, m, r)\nb = Admission(l, m)\n") \
        == ["Admission.from_options(o, m, r)", "Admission(l, m)"]
    assert admits("with self.state.admission.admit() as t:\n    t.reserve(w)\n"
                  "self.intake.admit()\n") == ["self.state.admission.admit()", "t.reserve(w)"]
