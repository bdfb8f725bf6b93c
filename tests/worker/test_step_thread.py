"""Stepping the core in the executor thread costs no throughput against stepping inline.

The core here does real torch matmuls per step (torch releases the GIL, like the model), and the
whole worker path is measured: AddRequest in, Outputs out over ZMQ. Best of a few runs per mode,
interleaved, so a noisy shared machine hurts both modes alike."""
from __future__ import annotations

import asyncio
import time

import torch

from engine.messages import Outputs, Ready

from .conftest import add_request
from .fake_core import FakeCore
from .test_worker import Harness

NUM_REQUESTS, NUM_TOKENS, NUM_RUNS = 8, 30, 3


class MatmulCore(FakeCore):
    """FakeCore whose step also does ~0.1 GFLOP of fp32 matmul, the size of a small decode."""

    def __init__(self, config, **knobs) -> None:
        super().__init__(config, **knobs)
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.randn(512, 512, generator=generator) / 512**0.5  # [hidden, hidden]
        self.hidden = torch.randn(48, 512, generator=generator)  # [num_tokens, hidden]

    def step(self):
        for _ in range(4):
            self.hidden = torch.tanh(self.hidden @ self.weight)
        return super().step()


async def tokens_per_second(raw_frontend, step_in_thread: bool) -> float:
    harness = Harness(raw_frontend, core_factory=MatmulCore, step_in_thread=step_in_thread)
    await raw_frontend.next(Ready)
    start = time.perf_counter()
    req_ids = {f"r{i}" for i in range(NUM_REQUESTS)}
    for req_id in req_ids:
        await raw_frontend.send(add_request(req_id, [1], max_tokens=NUM_TOKENS))
    num_tokens, pending = 0, set(req_ids)
    while pending:
        outputs = await raw_frontend.next(Outputs)
        num_tokens += sum(len(d.new_token_ids) for d in outputs.deltas)
        pending -= {d.req_id for d in outputs.deltas if d.finish_reason}
    elapsed = time.perf_counter() - start
    harness.task.cancel()
    await asyncio.gather(harness.task, return_exceptions=True)
    assert num_tokens == NUM_REQUESTS * NUM_TOKENS
    return num_tokens / elapsed


async def test_executor_thread_stepping_keeps_inline_throughput(raw_frontend):
    await tokens_per_second(raw_frontend, True)  # warm-up: torch's first matmuls are slow
    rates = {True: [], False: []}
    for _ in range(NUM_RUNS):
        for step_in_thread in (True, False):
            rates[step_in_thread].append(await tokens_per_second(raw_frontend, step_in_thread))
    threaded, inline = max(rates[True]), max(rates[False])
    assert threaded >= 0.85 * inline, f"threaded {threaded:.0f} tok/s vs inline {inline:.0f}"
