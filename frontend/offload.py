"""CPU-heavy request work kept off the event loop, and the bounds that cap it.

The loop serves every socket (health checks, streams, the worker channel), so nothing a client
sends may make it compute for long:

* Size first. aiohttp refuses a body over `--max-body-bytes` (413) before anything parses it,
  and the JSON depth is checked before decoding (frontend.body_limits).
* A bounded pool. Decoding a large body, rendering its chat and tokenizing it run in one of
  `num_threads` threads (`CpuPool.run`); small bodies stay inline, where a thread hop would
  cost more than the work. Jinja and the tokenizer's Python parts hold the GIL, but the
  interpreter hands it to the loop thread every switch interval (`duplex serve` sets 1 ms),
  so the loop answers within milliseconds while the pool is busy. One thread: two would
  take turns holding the GIL against the loop. (A process pool would isolate CPU better,
  but its arguments cross the process boundary by pickle.)
* A CPU budget per request. A template render stops at its `RenderLimits` (1 s, 10^6 steps);
  tokenizing is bounded by the text: a prompt with more characters than the context's
  tokens could hold (`max_model_len` x the longest token of the vocabulary) is refused
  with a 400 before it is tokenized (`check_prompt_chars`).
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from aiohttp import web

from duplex.frontend.errors import invalid

T = TypeVar("T")
INLINE_BELOW_BYTES = 64 * 1024
# `duplex serve` sets this GIL switch interval (Python's default is 5 ms): a pool thread in
# Python code then hands the GIL back to the loop within 1 ms.
SWITCH_INTERVAL_S = 0.001


class CpuPool:
    """Owns the threads that run request work too large for the loop."""

    def __init__(self, num_threads: int = 1, inline_below: int = INLINE_BELOW_BYTES,
                 max_body_bytes: int = 16 * 1024 * 1024) -> None:
        self.inline_below = inline_below
        self.max_body_bytes = max_body_bytes
        self._executor = ThreadPoolExecutor(max_workers=num_threads,
                                            thread_name_prefix="request-cpu")
        self.num_offloaded = 0

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args), in a pool thread when the input is `inline_below` bytes or more."""
        if size < self.inline_below:
            return fn(*args)
        self.num_offloaded += 1
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args))

    async def read_body(self, request: web.Request) -> bytes:
        """The whole body, refused with 413 past `max_body_bytes` as aiohttp's own read()
        would, but never in one long loop step: each chunk is taken as it arrives and a big
        body is joined in the pool."""
        chunks, size = [], 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes,
                                                    actual_size=size)
            chunks.append(chunk)
            await asyncio.sleep(0)  # chunks already buffered would otherwise run back to back
        return await self.run(size, b"".join, chunks)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


CPU_POOL = web.AppKey("cpu_pool", CpuPool)


def body_size(request: web.Request, template: str | None = None) -> int:
    """What `CpuPool.run` weighs a request's work by: its body's bytes, and a client's own
    chat template always counts as large (it may spend its whole render budget)."""
    size = request.content_length or 0
    return max(size, INLINE_BELOW_BYTES) if template is not None else size


def check_prompt_chars(num_chars: int, max_model_len: int, max_token_chars: int | None,
                       param: str) -> None:
    """400 when a text of `num_chars` characters cannot fit the context in any tokenization
    (each token covers at most `max_token_chars` of them); None: no bound is known."""
    if max_token_chars is None or num_chars <= max_model_len * max_token_chars:
        return
    raise invalid(f"the prompt has {num_chars} characters: even at {max_token_chars} "
                  f"characters per token (this vocabulary's longest) that is more than this "
                  f"model's context length of {max_model_len} tokens", param=param,
                  code="context_length_exceeded")


def longest_token_chars(recipe) -> int | None:
    """Characters of text one token can cover: the longest ordinary vocabulary entry (a
    byte-level entry has one symbol per byte, so at least one per character); control
    tokens never come from user text. None for a recipe without a tokenizer."""
    tokenizer = recipe.tokenizer
    if tokenizer is None:
        return None
    added = set(tokenizer.get_added_vocab())
    return max((len(t) for t in tokenizer.get_vocab() if t not in added), default=None)


def text_chars(value: Any) -> int:
    """Characters of all strings inside a JSON-like value (messages, tools)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(k) + text_chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0
