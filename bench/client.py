"""One streamed OpenAI chat completion, recorded into a `RequestRecord`.

Works against any OpenAI-compatible server. Reads the standard fields (`choices[].delta.content`,
`usage` with `prompt_tokens_details.cached_tokens`) and Duplex's optional `duplex` fields
(`draft_proposed` / `draft_accepted`: per chunk they are counts for that chunk; in usage they are
totals and win). Every way a request can go wrong ends as a status on the record, never as an
exception — except cancellation, which marks the record and propagates.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

import aiohttp

from duplex.bench.record import CANCELLED, FAILED, OK, REJECTED, RequestRecord

REJECT_STATUSES = (429, 503)
_MAX_ERROR_BODY = 300


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      headers: dict[str, str], record: RequestRecord,
                      timeout_s: float | None) -> None:
    """POST `body` to `url` and fill `record` with what came back and when."""
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.post(url, json=body, headers=headers, timeout=timeout) as response:
            record.http_status = response.status
            if response.status != 200:
                await _record_http_error(response, record)
            else:
                await _read_stream(response, record, start)
    except asyncio.CancelledError:
        record.fail("cancelled at deadline", status=CANCELLED)
        raise
    except TimeoutError:
        record.fail("timeout", f"no complete answer within {timeout_s} s")
    except aiohttp.ClientConnectorError as e:
        record.fail("connection error", str(e))
    except aiohttp.ClientPayloadError as e:
        record.fail("stream broken", str(e))
    except aiohttp.ClientError as e:
        record.fail("connection error", f"{type(e).__name__}: {e}")
    except ValueError as e:          # oversized SSE line
        record.fail("malformed stream", str(e))
    finally:
        if record.end_s is None and record.status != OK:
            record.end_s = time.perf_counter() - start


async def _record_http_error(response: aiohttp.ClientResponse, record: RequestRecord) -> None:
    text = (await response.text(errors="replace"))[:_MAX_ERROR_BODY]
    status = REJECTED if response.status in REJECT_STATUSES else FAILED
    record.fail(f"HTTP {response.status}", text, status=status)


async def _read_stream(response: aiohttp.ClientResponse, record: RequestRecord,
                       start: float) -> None:
    async for data in sse_data(response.content):
        now = time.perf_counter() - start
        if data == "[DONE]":
            record.end_s, record.status = now, OK
            return
        try:
            chunk = json.loads(data)
            if "error" in chunk:
                record.fail("error in stream", json.dumps(chunk["error"])[:_MAX_ERROR_BODY])
                return
            _apply_chunk(record, chunk, now)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            record.fail("malformed stream", f"{type(e).__name__}: {e}: {data[:100]!r}")
            return
    record.fail("stream ended before [DONE]", f"after {len(record.chunk_s)} content chunks")


def _apply_chunk(record: RequestRecord, chunk: dict, now: float) -> None:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        content = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        if content:
            record.chunk_s.append(now)
            record.text += content
    extra = chunk.get("duplex")
    if extra and not (chunk.get("usage") or {}).get("duplex"):
        record.draft_proposed = (record.draft_proposed or 0) + int(extra.get("draft_proposed", 0))
        record.draft_accepted = (record.draft_accepted or 0) + int(extra.get("draft_accepted", 0))
    if chunk.get("usage"):
        _apply_usage(record, chunk["usage"])


def _apply_usage(record: RequestRecord, usage: dict) -> None:
    record.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
    record.completion_tokens = _int_or_none(usage.get("completion_tokens"))
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = _int_or_none(details.get("cached_tokens"))
    extra = usage.get("duplex") or {}
    if "draft_proposed" in extra:
        record.draft_proposed = int(extra["draft_proposed"])
        record.draft_accepted = int(extra.get("draft_accepted", 0))


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


async def sse_data(stream: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The `data` payload of each server-sent event (multi-line data joined by newlines)."""
    lines: list[str] = []
    async for raw in stream:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
    if lines:
        yield "\n".join(lines)
