"""Reasoning in model output: the thinking block told apart from the answer, as text streams.

Owns: which reasoning formats exist (`--reasoning-parser`), whether one fits a chat template,
and the parse state of one output stream. Both formats write

    <think>
    the model's reasoning
    </think>

    the answer

| name        | where the block starts                                                       |
| ----------- | ---------------------------------------------------------------------------- |
| deepseek_r1 | in reasoning from the first token (R1 templates open `<think>` in the prompt; |
|             | a model that writes `<think>` itself is read the same), unless the prompt    |
|             | closed the block already                                                     |
| qwen3       | in reasoning only when the prompt opened `<think>` or the output starts with |
|             | it; `enable_thinking: false` renders an empty closed block, so no reasoning   |

The markers are read as text. Where a tokenizer makes them special tokens (so decoding with
`skip_special_tokens` drops them), `ReasoningFormat.split_ids` finds them among the token ids
and the caller pushes their text in their place: one parser for both cases. A tail that may
grow into a marker is held back, so neither channel ever sees part of one; blanks around the
block (the newline after `<think>`, the blank line after `</think>`) belong to neither.
A block never closed is all reasoning (the finish reason says why it ended).
"""
from __future__ import annotations

import re
from typing import NamedTuple

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# The text the engine writes to close a block whose budget is spent (what the models write).
CLOSE_TEXT = "\n" + END + "\n\n"


class Split(NamedTuple):
    """Text of one push, by channel."""
    reasoning: str
    answer: str


def check_parser_name(name: str) -> None:
    """Refuse an unknown parser name, listing the known ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(REASONING_PARSERS)}")


def detect_parser(template: str | None) -> str | None:
    """The parser a chat template asks for, when it is unambiguous: Qwen3's `enable_thinking`
    switch, or DeepSeek's `<｜Assistant｜>` turns around a thinking block. None otherwise."""
    if not template or END not in template:
        return None
    if "enable_thinking" in template:
        return "qwen3"
    if "<｜Assistant｜>" in template:
        return "deepseek_r1"
    return None


def check_fits(name: str, template: str | None) -> None:
    """Refuse a parser for a template that has no thinking block, with the reason."""
    check_parser_name(name)
    if not template:
        raise ValueError(f"reasoning parser {name!r} needs a chat template with a thinking "
                         "block, and the model has no chat template")
    if END not in template:
        raise ValueError(f"reasoning parser {name!r} does not fit this model: its chat "
                         f"template never writes or reads {END!r}, so the model has no "
                         "thinking block")


def template_has_thinking(template: str | None) -> bool:
    return bool(template) and END in template


class ReasoningFormat:
    """One parser name bound to a tokenizer: which marker ids are special (dropped by the
    detokenizer), and how a prompt's end says whether the block is open."""

    def __init__(self, name: str, marker_ids: dict[int, str] | None = None) -> None:
        check_parser_name(name)
        self.name = name
        self.marker_ids = marker_ids or {}  # special marker token id -> its text

    @classmethod
    def for_recipe(cls, name: str, recipe) -> ReasoningFormat:
        """The format with the marker ids `recipe`'s detokenizer would drop."""
        return cls(name, _special_marker_ids(recipe))

    def opens_in_prompt(self, prompt_tail: str) -> bool | None:
        """True: the prompt's end opened a block; False: it closed one; None: neither."""
        start, end = prompt_tail.rfind(START), prompt_tail.rfind(END)
        if start < 0 and end < 0:
            return None
        return start > end

    def constraint_start(self, prompt_tail: str = "") -> str:
        """Where an output constraint starts (`Constraint.thinking`), as `new_parser` reads the
        block: "open" after the block the output starts in, "may_open" after a block the
        output may write first (qwen3), "" at once where the prompt closed the block
        (`enable_thinking: false`: the template wrote an empty one)."""
        opened = self.opens_in_prompt(prompt_tail)
        if opened is False:
            return ""
        return "open" if opened or self.name == "deepseek_r1" else "may_open"

    def new_parser(self, prompt_tail: str = "") -> ReasoningParser:
        """The parser of one output stream after a prompt ending in `prompt_tail` (its last
        tokens decoded with special tokens kept)."""
        opened = self.opens_in_prompt(prompt_tail)
        if opened is None:
            opened = self.name == "deepseek_r1"
        return ReasoningParser(in_reasoning=opened, may_open=opened is not True)

    def split_ids(self, token_ids: list[int]) -> list[tuple[list[int], str]]:
        """The ids cut after each special marker id: [(ids before it, its text)], the last
        piece with text ""."""
        pieces: list[tuple[list[int], str]] = []
        start = 0
        for i, token_id in enumerate(token_ids):
            if token_id in self.marker_ids:
                pieces.append((token_ids[start:i], self.marker_ids[token_id]))
                start = i + 1
        pieces.append((token_ids[start:], ""))
        return pieces

    def push_ids(self, stream, token_ids: list[int], is_last: bool = False) -> str:
        """`stream.push` (an OutputStream) of new ids, with each special marker's text put
        back where its id was, so the parser sees it."""
        if not self.marker_ids:
            return stream.push(token_ids, is_last=is_last)
        pieces = self.split_ids(token_ids)
        return "".join(stream.push(ids, is_last=is_last and k == len(pieces) - 1) + marker
                       for k, (ids, marker) in enumerate(pieces))


def _special_marker_ids(recipe) -> dict[int, str]:
    tokenizer = getattr(recipe, "tokenizer", None)
    if tokenizer is None:
        return {}
    vocab = tokenizer.get_vocab()
    out = {}
    for marker in (START, END):
        token_id = vocab.get(marker)
        if token_id is not None and recipe.decode([token_id], skip_special_tokens=True) == "":
            out[token_id] = marker
    return out


# ---------------------------------------------------------------- the parse of one stream
_BEFORE, _THINKING, _AFTER, _ANSWER = "before", "thinking", "after", "answer"


class ReasoningParser:
    """Streaming split of one output: `push` text, then `finish` once; each returns the text
    now safe to emit per channel. How the text is split into pushes never changes the result.

    before    the output may still open a block (blanks, then `<think>` or not)
    thinking  reasoning until `</think>` (leading blanks dropped, trailing held back)
    after     blanks after `</think>` are dropped
    answer    everything else is the answer
    """

    def __init__(self, in_reasoning: bool, may_open: bool = True) -> None:
        self._state = _THINKING if in_reasoning else (_BEFORE if may_open else _ANSWER)
        self._pending = ""
        self._has_reasoning_text = False
        self.ended_reasoning = False  # the block was closed by `</think>`

    @property
    def in_reasoning(self) -> bool:
        return self._state == _THINKING

    @property
    def may_reason(self) -> bool:
        """True until the output is known to be answer only or its block closed."""
        return self._state in (_BEFORE, _THINKING)

    def push(self, text: str) -> Split:
        self._pending += text
        reasoning, answer = [], []
        while self._step(reasoning, answer, final=False):
            pass
        return Split("".join(reasoning), "".join(answer))

    def finish(self) -> Split:
        reasoning, answer = [], []
        while self._step(reasoning, answer, final=True):
            pass
        return Split("".join(reasoning), "".join(answer))

    def _step(self, reasoning: list[str], answer: list[str], final: bool) -> bool:
        """Consume what the current state can; True when the state changed."""
        if self._state == _BEFORE:
            return self._before(final)
        if self._state == _THINKING:
            return self._thinking(reasoning, final)
        if self._state == _AFTER:
            stripped = self._pending.lstrip()
            self._pending = stripped
            if stripped:
                self._state = _ANSWER
                return True
            return False
        answer.append(self._pending)
        self._pending = ""
        return False

    def _before(self, final: bool) -> bool:
        head = self._pending.lstrip()
        if head.startswith(START):
            self._pending = head[len(START):]
            self._state = _THINKING
            return True
        if START.startswith(head) and not final:
            return False  # blanks or a part of `<think>` so far: wait
        self._state = _ANSWER
        return True

    def _thinking(self, reasoning: list[str], final: bool) -> bool:
        if not self._has_reasoning_text:
            self._pending = self._pending.lstrip()
        at = self._pending.find(END)
        if at >= 0:
            self._emit_reasoning(reasoning, self._pending[:at].rstrip())
            self._pending = self._pending[at + len(END):]
            self._state, self.ended_reasoning = _AFTER, True
            return True
        keep = _partial(self._pending, END)
        body = self._pending[:len(self._pending) - keep]
        out = body.rstrip()
        # a partial marker cut by the end of the output is dropped, as are trailing blanks
        self._pending = "" if final else self._pending[len(out):]
        self._emit_reasoning(reasoning, out)
        return False

    def _emit_reasoning(self, reasoning: list[str], text: str) -> None:
        if text:
            reasoning.append(text)
            self._has_reasoning_text = True


def _partial(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


# variables the renderer itself sets: never a chat_template_kwargs key
RENDER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "documents",
                              "strftime_now", "raise_exception"})


def unread_template_kwarg(kwargs: dict | None, template: str | None,
                          param: str = "chat_template_kwargs") -> tuple[str, str] | None:
    """(param, message) for the first key of `kwargs` the chat template does not read (the
    server answers it with a 400, `LLM.chat` with a ValueError); None when it reads them all."""
    readable = template_variables(template) - RENDER_VARIABLES if template else frozenset()
    for key in kwargs or {}:
        if key not in readable:
            return f"{param}.{key}", (
                f"{param}.{key}: the chat template reads no variable {key!r}"
                + (f" (it reads {', '.join(sorted(readable))})" if readable else ""))
    return None


def template_variables(template: str) -> frozenset[str]:
    """Names a chat template reads that it does not set itself (what `chat_template_kwargs`
    may give)."""
    import jinja2
    from jinja2 import meta
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return frozenset(re.findall(r"\b([A-Za-z_]\w*)\b", template))
    return frozenset(meta.find_undeclared_variables(tree))
