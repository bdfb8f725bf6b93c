"""The recipe: chat messages become exactly the token ids the model expects, injection-safe.

Owns: the two-pass rendering of a chat and the encoder that lets only the template's own text
produce control tokens. It renders only a normalized `Chat` (engine/text/messages.py, which
validates what users hand in), the placeholders of the
symbolic render engine/text/symbolic.py, the budgeted Jinja sandbox engine/text/sandbox.py.

How template text is told apart from user text
----------------------------------------------
The template is rendered twice from the same messages:

* faithfully, with the real strings: the text transformers' `apply_chat_template` tokenizes;
* symbolically, with every user string (content, names, ids, tool schemas, tool-call
  arguments; also dict keys) replaced by a `_UserText`: a str whose characters are a unique
  placeholder but whose methods and comparisons act on the real text, so the template branches,
  strips, splits and JSON-escapes exactly as on the real string and each result is a new
  placeholder.

Splitting the symbolic output on placeholders and putting the real text back yields the faithful
text with every character labelled "template" or "user". If the two texts differ the template
did something to user text that cannot be traced, and the request fails (RecipeError) instead
of guessing. Only roles and `"type": "function"`, validated against fixed values, stay plain.

Encoding: when no control token's text occurs outside the template-written stretches, the
faithful text is tokenized exactly as transformers does, and every control token in the result
is checked (by its offsets) to lie inside one template stretch; benign chats take this path, so
they match transformers by construction. Otherwise the text is cut at the template's control
tokens and each section between them is tokenized with every control token switched off, so a
user's `<|im_end|>` becomes the plain-text tokens for those characters.
"""
from __future__ import annotations

import bisect
import functools
import os
import re
import time
from datetime import datetime

from duplex.engine.text.detokenizer import IncrementalDetokenizer
from duplex.engine.text.errors import RecipeError
from duplex.engine.text.messages import Chat
from duplex.engine.text.sandbox import RenderLimits, compile_template, render_template
from duplex.engine.text.symbolic import Ledger, Rendered
from duplex.engine.text.tokenizer import (chat_template, control_tokens, eos_token_ids, load_tokenizer,
                                   text_encoder)

__all__ = ["Chat", "Recipe", "RecipeError", "RenderLimits", "Rendered", "render_chat"]


def render_chat(template_source: str, messages: list[dict], tools: list[dict] | None,
                add_generation_prompt: bool, variables: dict,
                limits: RenderLimits = RenderLimits()) -> Rendered:
    """Render normalized messages and tools (a `Chat`'s) with template-written stretches
    marked: the faithful text, labelled through the symbolic render (module docstring)."""
    template = compile_template(template_source, limits.template_chars)
    deadline = time.monotonic() + limits.seconds   # for both renders together
    now = datetime.now()
    common = {**variables, "add_generation_prompt": add_generation_prompt, "documents": None,
              "strftime_now": now.strftime}
    faithful = render_template(template, {**common, "messages": messages, "tools": tools},
                               limits, None, deadline)
    ledger = Ledger()
    symbolic_messages = [_symbolize_message(ledger, message) for message in messages]
    symbolic_tools = None if tools is None else [ledger.symbolize(t, ("type",)) for t in tools]
    symbolic = render_template(template, {**common, "messages": symbolic_messages,
                                           "tools": symbolic_tools}, limits, ledger, deadline)
    rendered = ledger.resolve(symbolic)
    if rendered.text != faithful:
        raise RecipeError("the chat template transforms message text in a way the "
                          "injection-safe encoder cannot trace")
    return rendered


def _symbolize_message(ledger: Ledger, message: dict) -> dict:
    out = ledger.symbolize({k: v for k, v in message.items() if k != "tool_calls"}, ("role",))
    if "tool_calls" in message:
        out["tool_calls"] = [ledger.symbolize(call, ("type",)) for call in message["tool_calls"]]
    return {key: out[key] for key in message}   # keep the key order of the faithful message


# ---------------------------------------------------------------------------------------------
# The recipe of one model.

class Recipe:
    """Everything between a model's text interface and its token ids (see module docstring)."""

    def __init__(self, tokenizer, model_path: str | None = None,
                 limits: RenderLimits = RenderLimits()):
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.limits = limits
        self.eos_token_ids = eos_token_ids(tokenizer, model_path)
        self.control_tokens = control_tokens(tokenizer)            # text → id
        self.control_token_ids = frozenset(self.control_tokens.values())
        longest_first = sorted(self.control_tokens, key=len, reverse=True)
        self._control_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        added = tokenizer.added_tokens_decoder
        self._strips = {token_id: (added[token_id].lstrip, added[token_id].rstrip)
                        for token_id in self.control_token_ids if token_id in added}
        self._text = text_encoder(tokenizer)
        self._prompt_prefix = _added_prefix(tokenizer)
        self._variables = {key: value for key, value in tokenizer.special_tokens_map.items()}
        try:
            self.template: str | None = chat_template(tokenizer)
        except ValueError:
            self.template = None

    @property
    def vocab_size(self) -> int:
        """Token ids run below this (the tokenizer's, added tokens included)."""
        return len(self.tokenizer)

    @classmethod
    def from_model(cls, model_path: str) -> Recipe:
        """The (cached) recipe of a local GGUF file or Hugging Face directory."""
        return _recipe_for(os.path.realpath(model_path))

    def render_chat(self, chat: Chat, add_generation_prompt: bool = True,
                    template: str | None = None, variables: dict | None = None) -> Rendered:
        """The chat as text, with the stretches the template wrote. `variables`: more
        template variables (a request's `chat_template_kwargs`, e.g. enable_thinking)."""
        source = self.template if template is None else template
        if source is None:
            raise RecipeError("the model has no chat template; pass `template`")
        return render_chat(source, _checked(chat).messages, chat.tools,
                           bool(add_generation_prompt), {**self._variables, **(variables or {})},
                           self.limits)

    def encode_chat(self, chat: Chat, add_generation_prompt: bool = True,
                    template: str | None = None,
                    continue_final_message: bool = False,
                    variables: dict | None = None) -> list[int]:
        """Token ids of a chat: control tokens only where the template wrote them.

        continue_final_message: the last message is the start of the assistant's reply
        (Anthropic's prefill, vLLM's `continue_final_message`): the history is rendered with
        the generation prompt and the reply's text follows as plain text (never a control
        token), so the model continues it instead of starting a new turn."""
        if continue_final_message:
            history, prefix = _split_final_assistant(_checked(chat))
            return (self.encode_chat(history, True, template, variables=variables)
                    + self._text_ids(prefix, at_start=False))
        rendered = self.render_chat(chat, add_generation_prompt, template, variables)
        return self._encode_rendered(rendered)

    def count_chat_tokens(self, chat: Chat, add_generation_prompt: bool = True,
                          template: str | None = None) -> int:
        return len(self.encode_chat(chat, add_generation_prompt, template))

    def encode_prompt(self, text: str) -> list[int]:
        """A plain completion prompt: no control tokens from the text; BOS only if the
        tokenizer adds one."""
        if not isinstance(text, str):
            raise RecipeError("prompt must be a string")
        return self._prompt_prefix + self._text_ids(text, at_start=True)

    def encode_completion(self, text: str) -> list[int]:
        """A prompt the caller wrote whole (`/v1/completions`, `LLM.generate`): no template
        separates user text from control tokens, so a control token's text is that token, as
        in llama.cpp and vLLM (docs/control-tokens.md); BOS only if the tokenizer adds one."""
        if not isinstance(text, str):
            raise RecipeError("prompt must be a string")
        return self._prompt_prefix + list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_reply_start(self, text: str) -> list[int]:
        """Ids of text the server writes at the start of the reply (a forced tool call's tag
        and header), as the model would write it, control tokens included. Never user text."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def new_detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=skip_special_tokens)

    def _encode_rendered(self, rendered: Rendered) -> list[int]:
        starts = [start for start, _ in rendered.template_spans]
        if any(not _inside(rendered.template_spans, starts, match.span())
               for match in self._control_re.finditer(rendered.text)):
            return self._encode_sections(rendered)   # user text holds a control token's text
        encoding = self.tokenizer(rendered.text, add_special_tokens=False,
                                  return_offsets_mapping=True)
        ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
        if all(_inside(rendered.template_spans, starts, offsets[i])
               for i, token_id in enumerate(ids) if token_id in self.control_token_ids):
            return list(ids)
        return self._encode_sections(rendered)

    def _encode_sections(self, rendered: Rendered) -> list[int]:
        """Cut at the template's control tokens; encode the text between with them off."""
        text, ids, pos = rendered.text, [], 0
        for start, end, token_id in self._template_controls(rendered):
            lstrip, rstrip = self._strips.get(token_id, (False, False))
            section = text[pos:start]
            ids += self._text_ids(section.rstrip() if lstrip else section, at_start=pos == 0)
            ids.append(token_id)
            pos = end
            while rstrip and pos < len(text) and text[pos].isspace():
                pos += 1
        return ids + self._text_ids(text[pos:], at_start=pos == 0)

    def _template_controls(self, rendered: Rendered):
        for start, end in rendered.template_spans:
            for match in self._control_re.finditer(rendered.text, start, end):
                yield match.start(), match.end(), self.control_tokens[match.group()]

    def _text_ids(self, text: str, at_start: bool) -> list[int]:
        """Plain-text ids; should merges ever build a control token, the text is split inside it."""
        if not text:
            return []
        encoding = self._text.encode(text, at_start)
        for i, token_id in enumerate(encoding.ids):
            if token_id in self.control_token_ids:
                start, end = encoding.offsets[i]
                if end - start < 2:
                    raise RecipeError(f"{text[start:end]!r} only encodes as a control token")
                middle = (start + end) // 2
                return (self._text_ids(text[:middle], at_start)
                        + self._text_ids(text[middle:], at_start=False))
        return list(encoding.ids)


def _checked(chat: Chat) -> Chat:
    if not isinstance(chat, Chat):
        raise TypeError(f"the recipe renders a Chat (Chat.from_dicts validates plain dicts), "
                        f"got {type(chat).__name__}")
    return chat


def _split_final_assistant(chat: Chat) -> tuple[Chat, str]:
    messages = chat.messages
    if not messages or messages[-1]["role"] != "assistant":
        raise RecipeError("continuing the final message needs a final assistant message")
    if messages[-1].get("tool_calls"):
        raise RecipeError("the final assistant message to continue must be plain text")
    if len(messages) == 1:
        raise RecipeError("continuing the final message needs a message before it")
    return chat._replace(messages=list(messages[:-1])), messages[-1]["content"]


def _inside(spans: list[tuple[int, int]], starts: list[int], offset: tuple[int, int]) -> bool:
    k = bisect.bisect_right(starts, offset[0]) - 1
    return k >= 0 and offset[1] <= spans[k][1]


def _added_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before plain text (BOS for Llama-style tokenizers)."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    for k in range(len(with_special) - len(without) + 1):
        if with_special[k:k + len(without)] == without:
            return list(with_special[:k])
    return []


@functools.lru_cache(maxsize=8)
def _recipe_for(model_path: str) -> Recipe:
    return Recipe(load_tokenizer(model_path), model_path=model_path)
