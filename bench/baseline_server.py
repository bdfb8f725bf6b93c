"""`duplex bench baseline-server`: what a user without a serving engine would run.

A minimal OpenAI-compatible server (`POST /v1/chat/completions` with SSE streaming, `GET
/v1/models`, `GET /health`) over plain transformers: the chat template from the tokenizer,
`model.generate` in one worker thread, one request at a time by default, or static left-padded
batches of up to `--batch-size` requests gathered for `--batch-window-ms`. A batch runs until
its last member finishes; members with other sampling settings wait for a later batch. Usage
reports `cached_tokens` 0: there is no prefix cache.

Request flow: handler → `_Job` on `BaselineEngine.pending` → batch → `generate` in the thread,
whose streamer hands each new token to its job → text deltas on the job's asyncio queue →
SSE chunks.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import sys
import time
import uuid
from typing import Any

import torch
from aiohttp import web
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

_END = object()                       # last item on a job's delta queue
_DEFAULT_MAX_TOKENS = 256


class _Job:
    """One chat request inside the baseline server (written by the generate thread)."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, body: dict,
                 loop: asyncio.AbstractEventLoop):
        self.prompt_ids, self.max_tokens = prompt_ids, max_tokens
        self.temperature = _number(body, "temperature", 1.0)
        self.top_p = _number(body, "top_p", 1.0)
        self.ignore_eos = bool(body.get("ignore_eos", False))
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.is_cancelled = False
        self.deltas: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._prefix_offset = self._read_offset = 0

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None or self.is_cancelled

    @property
    def sampling_key(self) -> tuple:
        return (self.temperature, self.top_p) if self.temperature > 0 else (0.0, 1.0)

    def add_token(self, token_id: int, tokenizer, eos_ids: set[int]) -> None:
        """Called from the generate thread; ignores tokens after the job has finished."""
        if self.is_done:
            return
        self.token_ids.append(token_id)
        if token_id in eos_ids and not self.ignore_eos:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"
        delta = self._next_text(tokenizer)
        if delta:
            self._loop.call_soon_threadsafe(self.deltas.put_nowait, delta)
        if self.finish_reason:
            self._loop.call_soon_threadsafe(self.deltas.put_nowait, _END)

    def close(self, error: str | None = None) -> None:
        """End the job's stream (from the generate thread), whatever state it is in."""
        if self.finish_reason is None:
            self.finish_reason, self.error = ("error" if error else "length"), error
            self._loop.call_soon_threadsafe(self.deltas.put_nowait, _END)

    def _next_text(self, tokenizer) -> str:
        """Incremental detokenization: emit text only once it no longer ends mid-character."""
        ids = self.token_ids
        before = tokenizer.decode(ids[self._prefix_offset:self._read_offset],
                                  skip_special_tokens=True)
        after = tokenizer.decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return after[len(before):]


class BaselineEngine:
    """Owns the model, the pending jobs and the one thread that runs `generate`."""

    def __init__(self, model, tokenizer, batch_size: int = 1, batch_window_s: float = 0.02):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.batch_window_s = batch_size, batch_window_s
        self.pending: asyncio.Queue[_Job] = asyncio.Queue()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="generate")
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else min(self.eos_ids)
        self.context_len = int(getattr(model.config, "max_position_embeddings", 2048))

    async def loop(self) -> None:
        while True:
            batch = await self._gather()
            while batch:
                key = batch[0].sampling_key
                group = [j for j in batch if j.sampling_key == key]
                batch = [j for j in batch if j.sampling_key != key]
                await asyncio.get_running_loop().run_in_executor(
                    self.executor, self._generate, group)

    async def _gather(self) -> list[_Job]:
        batch = [await self.pending.get()]
        deadline = time.monotonic() + self.batch_window_s
        while len(batch) < self.batch_size and (left := deadline - time.monotonic()) > 0:
            try:
                batch.append(await asyncio.wait_for(self.pending.get(), left))
            except TimeoutError:
                break
        return [job for job in batch if not job.is_cancelled]

    def _generate(self, jobs: list[_Job]) -> None:
        try:
            inputs = self._inputs(jobs)
            with torch.inference_mode():
                self.model.generate(**inputs, **self._settings(jobs, inputs["input_ids"].shape[1]))
        except Exception as e:  # noqa: BLE001 — reported to every client of the batch
            for job in jobs:
                job.close(f"{type(e).__name__}: {e}")
        for job in jobs:
            job.close()

    def _inputs(self, jobs: list[_Job]) -> dict:
        width = max(len(j.prompt_ids) for j in jobs)
        # input_ids, attention_mask: [batch, width], left-padded
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for row, job in enumerate(jobs):
            ids[row, width - len(job.prompt_ids):] = torch.tensor(job.prompt_ids)
            mask[row, width - len(job.prompt_ids):] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def _settings(self, jobs: list[_Job], prompt_width: int) -> dict:
        temperature, top_p = jobs[0].sampling_key
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} \
            if temperature > 0 else {"do_sample": False}
        # No eos_token_id: each job decides when it ends (ignore_eos is per request).
        config = GenerationConfig(max_new_tokens=max(j.max_tokens for j in jobs),
                                  pad_token_id=self.pad_id, eos_token_id=None, **sampling)
        return {"generation_config": config, "streamer": _Streamer(self, jobs),
                "stopping_criteria": StoppingCriteriaList(
                    [_JobsDone(jobs, prompt_width, self.eos_ids)])}


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


class _Streamer(BaseStreamer):
    """Hands each generated token of row i to job i (the first put is the prompt)."""

    def __init__(self, engine: BaselineEngine, jobs: list[_Job]):
        self.engine, self.jobs, self.is_prompt = engine, jobs, True

    def put(self, value) -> None:
        if self.is_prompt:
            self.is_prompt = False
            return
        for job, token_id in zip(self.jobs, value.reshape(-1).tolist()):
            job.add_token(token_id, self.engine.tokenizer, self.engine.eos_ids)

    def end(self) -> None:
        pass


class _JobsDone(StoppingCriteria):
    """Row i stops once job i is done, judged from `input_ids` itself so that it holds
    whether generate calls the streamer before or after its stopping criteria."""

    def __init__(self, jobs: list[_Job], prompt_width: int, eos_ids: set[int]):
        self.jobs, self.prompt_width, self.eos_ids = jobs, prompt_width, eos_ids

    def __call__(self, input_ids, scores, **kwargs):
        num_generated = input_ids.shape[1] - self.prompt_width
        last_ids = input_ids[:, -1].tolist()
        return torch.tensor([
            job.is_done or num_generated >= job.max_tokens
            or (last_id in self.eos_ids and not job.ignore_eos)
            for job, last_id in zip(self.jobs, last_ids)], device=input_ids.device)


# ----- HTTP ----------------------------------------------------------------------------------

class _BadRequest(Exception):
    pass


class BaselineServer:
    """The HTTP side: validates requests, queues jobs on the engine, streams their deltas."""

    def __init__(self, engine: BaselineEngine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.cleanup_ctx.append(self._engine_loop)
        return app

    async def _engine_loop(self, app: web.Application):
        task = asyncio.create_task(self.engine.loop())
        yield
        task.cancel()
        self.engine.executor.shutdown(wait=False, cancel_futures=True)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "baseline"}]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            job = self._job(body)
        except (ValueError, _BadRequest) as e:
            return _error(400, str(e))
        self.engine.pending.put_nowait(job)
        try:
            if body.get("stream"):
                return await self._stream(request, job, body)
            return await self._complete(job)
        finally:
            job.is_cancelled = True        # a no-op once finished; stops a deserted job

    def _job(self, body: Any) -> _Job:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) \
                or not body["messages"]:
            raise _BadRequest("'messages' must be a non-empty list")
        messages = [_message(m) for m in body["messages"]]
        tokenizer = self.engine.tokenizer
        prompt = tokenizer.apply_chat_template(messages, tools=body.get("tools") or None,
                                               add_generation_prompt=True, tokenize=False)
        prompt_ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        room = self.engine.context_len - len(prompt_ids)
        if room < 1:
            raise _BadRequest(f"prompt has {len(prompt_ids)} tokens; the context holds "
                              f"{self.engine.context_len}")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") \
            or _DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise _BadRequest("'max_tokens' must be a positive integer")
        return _Job(prompt_ids, min(max_tokens, room), body, asyncio.get_running_loop())

    async def _stream(self, request: web.Request, job: _Job, body: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunk = _Chunk(self.model_name)
        await _send(response, chunk.delta({"role": "assistant", "content": ""}))
        while (delta := await job.deltas.get()) is not _END:
            await _send(response, chunk.delta({"content": delta}))
        if job.error:
            await _send(response, {"error": {"message": job.error, "type": "server_error"}})
        else:
            await _send(response, chunk.delta({}, job.finish_reason))
            if (body.get("stream_options") or {}).get("include_usage"):
                await _send(response, chunk.usage(_usage(job)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _complete(self, job: _Job) -> web.Response:
        parts = []
        while (delta := await job.deltas.get()) is not _END:
            parts.append(delta)
        if job.error:
            return _error(500, job.error)
        chunk = _Chunk(self.model_name)
        return web.json_response({
            "id": chunk.id, "object": "chat.completion", "created": chunk.created,
            "model": self.model_name, "usage": _usage(job),
            "choices": [{"index": 0, "finish_reason": job.finish_reason,
                         "message": {"role": "assistant", "content": "".join(parts)}}]})


class _Chunk:
    """Builds the `chat.completion.chunk` objects of one stream."""

    def __init__(self, model_name: str):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created, self.model_name = int(time.time()), model_name

    def delta(self, delta: dict, finish_reason: str | None = None) -> dict:
        return self._chunk([{"index": 0, "delta": delta, "finish_reason": finish_reason}])

    def usage(self, usage: dict) -> dict:
        return self._chunk([]) | {"usage": usage}

    def _chunk(self, choices: list) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model_name, "choices": choices}


def _message(message: Any) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _BadRequest("each message needs a 'role'")
    content = message.get("content") or ""
    if isinstance(content, list):                  # OpenAI content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise _BadRequest("message 'content' must be a string or a list of parts")
    return {"role": message["role"], "content": content}


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or value < 0:
        raise _BadRequest(f"'{name}' must be a non-negative number")
    return float(value)


def _usage(job: _Job) -> dict:
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": len(job.token_ids),
            "total_tokens": len(job.prompt_ids) + len(job.token_ids),
            "prompt_tokens_details": {"cached_tokens": 0}}


async def _send(response: web.StreamResponse, data: dict) -> None:
    await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"
                                        if status < 500 else "server_error"}}, status=status)


# ----- CLI -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="GGUF file or HF directory (default: the default model)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--batch-size", type=int, default=1,
                        help="largest static batch (1 = one request at a time)")
    parser.add_argument("--batch-window-ms", type=float, default=20.0,
                        help="how long a batch waits for more requests to join")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run(args: argparse.Namespace) -> int:
    from duplex.bench.hf import load_model, load_tokenizer
    if args.batch_size < 1:
        print("duplex bench baseline-server: --batch-size must be at least 1", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer, model = load_tokenizer(args.model), load_model(args.model)
    name = args.served_model_name or _model_name(args.model)
    engine = BaselineEngine(model, tokenizer, args.batch_size, args.batch_window_ms / 1e3)
    print(f"baseline-server: {name} on http://{args.host}:{args.port} "
          f"(batch size {args.batch_size})", flush=True)
    web.run_app(BaselineServer(engine, name).app(), host=args.host, port=args.port,
                print=None, handle_signals=True)
    return 0


def _model_name(path: str | None) -> str:
    if path is None:
        from duplex.engine.config import DEFAULT_MODEL_NAME
        return DEFAULT_MODEL_NAME
    return path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
