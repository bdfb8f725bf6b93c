"""The Jinja sandbox chat templates render in: transformers' setup, plus a budget.

Owns: what one render may spend (RenderLimits) and the environment that charges every loop,
call, lookup and built value to the current render's budget. A template is untrusted code:
whatever it does fails as a RecipeError, never as a crash or a hang.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import re
import time
from contextvars import ContextVar
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from duplex.engine.text.errors import RecipeError, short
from duplex.engine.text.symbolic import Ledger


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    """What rendering one chat may spend; a template that exceeds any of them fails."""
    seconds: float = 1.0            # wall time, both renders together
    steps: int = 1_000_000          # per render: loop iterations, calls, attribute/item lookups
    chars: int = 16_000_000         # longest string the template may build, output included
    built: int = 256_000_000        # per render: chars + items of all strings/lists it builds
    template_chars: int = 256_000   # longest template source accepted
    int_arg: int = 100_000          # largest number a filter or method takes (widths, counts)

    def __post_init__(self):
        if min(dataclasses.astuple(self)) <= 0:
            raise ValueError(f"render limits must be positive: {self}")


class _Budget:
    """What the current render may still spend; `ledger` is set for the symbolic render."""

    def __init__(self, limits: RenderLimits, ledger: Ledger | None, deadline: float):
        self.limits, self.ledger, self.deadline = limits, ledger, deadline
        self.steps_left, self.built_left = limits.steps, limits.built
        self._measured: dict[int, tuple[Any, int]] = {}   # id → (value kept alive, size)

    def tick(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise RecipeError(f"chat template exceeded {self.limits.steps} steps")
        if time.monotonic() > self.deadline:
            raise RecipeError(f"chat template ran longer than {self.limits.seconds} s")

    def check_size(self, size: int) -> None:
        if size > self.limits.chars:
            raise RecipeError(f"chat template built a string over {self.limits.chars} chars")

    def check_args(self, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            if type(value) is int and abs(value) > self.limits.int_arg:
                raise RecipeError(f"chat template passed {value} to a function "
                                  f"(limit {self.limits.int_arg})")

    def check_items(self, count: int) -> None:
        if count > self.limits.steps:
            raise RecipeError(f"chat template built a collection over {self.limits.steps} items")

    def measure(self, value: Any, nested: bool = False) -> int:
        """The size of `value` written out as text (what str() or tojson would produce): shared
        parts count every time they occur, so `[x, x]` nested 40 deep is refused long before
        printing it could take forever. Templates cannot mutate lists or dicts, so a size, once
        known, stays true; namespaces (mutable) may not be put inside other values."""
        if isinstance(value, str):
            return len(value) + 1
        if isinstance(value, Namespace):
            if nested:
                raise RecipeError("chat template put a namespace inside another value")
            return 1
        if not isinstance(value, (list, tuple, dict, set, frozenset)):
            return 1
        known = self._measured.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        parts = itertools.chain(value.keys(), value.values()) if isinstance(value, dict) else value
        size = 1 + sum(self.measure(part, nested=True) for part in parts)
        self._measured[id(value)] = (value, size)
        if size > self.limits.chars:
            raise RecipeError(f"chat template built a value over {self.limits.chars} chars long")
        return size

    def check_result(self, value: Any) -> Any:
        """A freshly built value: sized, and its size spent from the `built` budget (which
        bounds what a template can hold on to, e.g. by appending copies to a list)."""
        if isinstance(value, str):
            self.check_size(len(value))
        elif isinstance(value, (list, tuple, dict, set, frozenset)):
            self.check_items(len(value))
            self.measure(value)
        elif type(value) is int and value.bit_length() > 65536:
            raise RecipeError("chat template built an integer that is too large")
        else:
            return value
        self.built_left -= len(value)
        if self.built_left < 0:
            raise RecipeError(f"chat template built over {self.limits.built} chars and items")
        return value


_BUDGET: ContextVar[_Budget] = ContextVar("duplex_render_budget")
_WIDE_FORMAT = re.compile(r"\d{6,}|%[-+ #0]*\*|\{[^{}]*\{")   # huge widths, * widths, nesting


def _budget() -> _Budget:
    try:
        return _BUDGET.get()
    except LookupError:
        raise RecipeError("chat templates render only through Recipe") from None


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _WIDE_FORMAT.search(str.__str__(fmt)):
        raise RecipeError("chat template used a format with a huge or indirect width")


def _check_growth(name: str, subject: Any, args: tuple, budget: _Budget) -> None:
    """Refuse string operations whose result would blow past the size limit before running."""
    if not isinstance(subject, str):
        return
    if name == "replace" and len(args) >= 2 and isinstance(args[1], str):
        budget.check_size(len(subject) + (len(subject) + 1) * len(args[1]))
    elif name == "indent":
        width = args[0] if args else 4
        width = len(width) if isinstance(width, str) else width if type(width) is int else 0
        budget.check_size(len(subject) + (subject.count("\n") + 1) * width)
    elif name == "expandtabs":
        width = args[0] if args and type(args[0]) is int else 8
        budget.check_size(len(subject) + subject.count("\t") * width)
    elif name == "format":
        _check_format(subject)


def _join_items(sep: Any, items: Any, budget: _Budget) -> Any:
    """The items of a join, listed if they come from an iterator, sized before joining."""
    if not isinstance(items, (str, list, tuple, dict, set)):
        items = list(itertools.islice(items, budget.limits.steps + 1))
    budget.check_items(len(items))
    if isinstance(sep, str):
        budget.check_size(len(items) * len(sep))
    return items


def _guard_filter(name: str, filter_fn):
    injected = getattr(filter_fn, "jinja_pass_arg", None) is not None  # env/context comes first

    @functools.wraps(filter_fn)
    def guarded(*args, **kwargs):
        budget = _budget()
        budget.tick()
        values = args[1:] if injected else args
        budget.check_args(values[1:], kwargs)
        if values:
            _check_growth(name, values[0], values[1:], budget)
        if name == "join" and values:
            separator = values[1] if len(values) > 1 else kwargs.get("d", "")
            items = _join_items(separator, values[0], budget)
            args = (*args[:len(args) - len(values)], items, *values[1:])
        if name == "tojson":
            _check_indent(kwargs.get("indent", values[2] if len(values) > 2 else None))
        return budget.check_result(filter_fn(*args, **kwargs))

    return guarded


def _check_indent(indent: Any) -> None:
    width = len(indent) if isinstance(indent, str) else indent if type(indent) is int else 0
    if width > 16:
        raise RecipeError("chat template asked for a JSON indent over 16")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson; in the symbolic render user text inside comes out JSON-escaped."""
    ledger = _budget().ledger
    if ledger is None:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)
    text = json.dumps(ledger.json_ready(value, sort_keys), ensure_ascii=ensure_ascii,
                      indent=indent, separators=separators)
    return ledger.escape_json(text, ensure_ascii)


def _raise_exception(message):
    raise TemplateError(message)


def _dict(*args, **kwargs):
    return dict(*args, **kwargs)


class _Namespace(Namespace):
    """Jinja's namespace, refusing underscore names (as transformers does)."""

    def __init__(*args, **kwargs):  # noqa: N805 -- Jinja's signature, so `self=` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _Namespace._check(name, value)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name, value)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name, value):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} is not allowed")
        _budget().measure(value, nested=True)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with every step paid for and sized."""
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[loopcontrols, _GenerationTag])
        self.globals.pop("lipsum", None)
        self.globals.update(raise_exception=_raise_exception, dict=_dict, namespace=_Namespace)
        self.filters["tojson"] = _tojson
        for name, filter_fn in list(self.filters.items()):
            self.filters[name] = _guard_filter(name, filter_fn)

    def getattr(self, obj, attribute):
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        budget = _budget()
        budget.tick()
        value = super().getitem(obj, argument)
        return budget.check_result(value) if isinstance(argument, slice) else value

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to {attribute!r} of a {type(obj).__name__} is not allowed")

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            _check_format(value.__self__)
        return wrapper

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- Jinja's convention
        budget = _budget()
        budget.tick()
        budget.check_args(args, kwargs)
        name, subject = getattr(__obj, "__name__", ""), getattr(__obj, "__self__", None)
        _check_growth(name, subject, args, budget)
        if name == "join" and isinstance(subject, str) and args:
            args = (_join_items(subject, args[0], budget), *args[1:])
        return budget.check_result(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        budget = _budget()
        budget.tick()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, str) and type(count) is int:
                    budget.check_size(len(seq) * count)
                elif isinstance(seq, (list, tuple)) and type(count) is int:
                    budget.check_items(len(seq) * count)
        elif operator == "**" and type(left) is int and type(right) is int:
            if right > 4096 or left.bit_length() * max(right, 0) > 65536:
                raise RecipeError("chat template raised a number to a huge power")
        elif operator == "+" and isinstance(left, str) and isinstance(right, str):
            budget.check_size(len(left) + len(right))
        elif operator == "+" and isinstance(left, (list, tuple)) and hasattr(right, "__len__"):
            budget.check_items(len(left) + len(right))
        elif operator == "%":
            _check_format(left)
        return budget.check_result(super().call_binop(context, operator, left, right))

    def budget_iter(self, iterable):
        """Wraps every `{% for %}` iterable: each iteration is a step."""
        budget = _budget()
        for item in iterable:
            budget.tick()
            yield item

    def budget_slice(self, obj, start, stop, step):
        """Replaces `obj[a:b:c]`, which Jinja compiles to a plain subscript."""
        budget = _budget()
        budget.tick()
        return budget.check_result(obj[start:stop:step])

    def budget_container(self, value):
        """Wraps list, tuple and dict literals: their written-out size is measured."""
        budget = _budget()
        budget.tick()
        return budget.check_result(value)

    def concat(self, parts):
        """Joins block bodies (`{% set x %}`, macros, filter blocks); Jinja's is `"".join`."""
        parts = list(parts)
        budget = _budget()
        budget.tick()
        budget.check_size(sum(map(len, parts)))
        return budget.check_result("".join(parts))

    def budget_concat(self, items):
        """Replaces `~`: the joined size is checked before the join."""
        parts = [str(item) for item in items]
        budget = _budget()
        budget.tick()
        budget.check_size(sum(map(len, parts)))
        return budget.check_result("".join(parts))


@functools.lru_cache(maxsize=1)
def _sandbox() -> _Sandbox:
    return _Sandbox()


def compile_template(source: str, max_chars: int):
    """A template compiled in the sandbox with its budget nodes (cached by source)."""
    if not isinstance(source, str):
        raise RecipeError("a chat template must be a string")
    return _compile_cached(source, max_chars)


@functools.lru_cache(maxsize=64)
def _compile_cached(source: str, max_chars: int):
    if len(source) > max_chars:
        raise RecipeError(f"chat template is longer than {max_chars} chars")
    env = _sandbox()
    try:
        tree = env.parse(source)
        _add_budget_nodes(tree)
        return env.from_string(tree)
    except TemplateError as error:
        raise RecipeError(f"chat template does not compile: {error}") from None
    except (RecursionError, MemoryError, SyntaxError, ValueError) as error:
        raise RecipeError(f"chat template does not compile: {type(error).__name__}") from None


def _add_budget_nodes(node: nodes.Node) -> None:
    """Rewrite the template's syntax tree: loops iterate through `budget_iter`, `~` joins
    through `budget_concat`, slices go through `budget_slice`, list/tuple/dict literals through
    `budget_container`."""
    for field, value in node.iter_fields():
        if isinstance(value, nodes.Node):
            setattr(node, field, _budgeted(value))
        elif isinstance(value, list):
            setattr(node, field, [_budgeted(v) if isinstance(v, nodes.Node) else v
                                  for v in value])


def _budgeted(node: nodes.Node) -> nodes.Node:
    _add_budget_nodes(node)
    if isinstance(node, nodes.For):
        node.iter = _env_call("budget_iter", node.iter, node.lineno)
    elif isinstance(node, nodes.Concat):
        return _env_call("budget_concat", nodes.List(node.nodes, lineno=node.lineno), node.lineno)
    elif isinstance(node, (nodes.List, nodes.Dict)) or (isinstance(node, nodes.Tuple)
                                                         and node.ctx == "load"):
        return _env_call("budget_container", node, node.lineno)
    elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        bounds = [part or nodes.Const(None, lineno=node.lineno)
                  for part in (node.arg.start, node.arg.stop, node.arg.step)]
        return _env_call("budget_slice", node.node, node.lineno, *bounds)
    return node


def _env_call(name: str, arg: nodes.Expr, lineno: int, *more: nodes.Expr) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(name, lineno=lineno), [arg, *more], [], None,
                      None, lineno=lineno)


def render_template(template, context: dict, limits: RenderLimits, ledger: Ledger | None,
                    deadline: float) -> str:
    """Render under a fresh budget; `ledger` set: the symbolic render. Any failure of the
    template (untrusted code) is a RecipeError."""
    budget = _Budget(limits, ledger, deadline)
    token = _BUDGET.set(budget)
    try:
        chunks, size = [], 0
        for chunk in template.generate(**context):
            size += len(chunk)
            budget.check_size(size)
            chunks.append(chunk)
        return "".join(chunks)
    except RecipeError:
        raise
    except TemplateError as error:
        raise RecipeError(f"chat template error: {short(str(error))}") from None
    except Exception as error:  # a template is untrusted code: any failure is the request's
        raise RecipeError(f"chat template failed: {type(error).__name__}: "
                          f"{short(str(error))}") from None
    finally:
        _BUDGET.reset(token)

