"""Fixtures for the prefill/decode split: a tiny random Llama saved as a Hugging Face
directory (built once, reused across runs), a supervised cluster of real worker processes
on loopback with its EngineClient, and the unified in-process reference."""
from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from duplex.engine.config import EngineConfig
from duplex.engine.messages import AddRequest, RequestDelta
from duplex.engine.sampling_params import SamplingParams
from duplex.frontend.engine_client import EngineClient
from duplex.frontend.metrics import worker_figures
from duplex.frontend.router import Router
from duplex.frontend.supervisor import Supervisor

REPO = Path(__file__).resolve().parents[2]
TINY_DIR = Path("/tmp/pd_tiny_llama_v1")
VOCAB = 384
MAX_MODEL_LEN = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def tiny_model() -> str:
    """A 3-layer Llama with random weights (varied greedy outputs), saved once."""
    if (TINY_DIR / "config.json").is_file():
        return str(TINY_DIR)
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    staging = Path(f"{TINY_DIR}.{os.getpid()}")
    model.save_pretrained(staging, safe_serialization=True)
    try:
        staging.rename(TINY_DIR)
    except OSError:  # another process won the race
        shutil.rmtree(staging, ignore_errors=True)
    return str(TINY_DIR)


def engine_config(**overrides) -> EngineConfig:
    values = dict(model=tiny_model(), num_kv_blocks=96, max_model_len=MAX_MODEL_LEN,
                  max_num_batched_tokens=64, num_threads=1)
    values.update(overrides)
    return EngineConfig.of(**values)


def request(req_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> AddRequest:
    return AddRequest(req_id, prompt, params)


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def finals(deltas: list[RequestDelta]) -> list[tuple[str, str]]:
    return [(d.finish_reason, d.error) for d in deltas if d.finish_reason is not None]


async def collect(client: EngineClient, msg: AddRequest) -> list[RequestDelta]:
    return [delta async for delta in client.generate(msg)]


async def until(predicate, timeout_s: float = 30.0, interval_s: float = 0.05) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(interval_s)


def unified_reference(prompts: dict[str, list[int]], params: SamplingParams = GREEDY,
                      **config) -> dict[str, list[int]]:
    """Greedy tokens of each prompt from an in-process unified EngineCore."""
    from duplex.engine.core import EngineCore

    core = EngineCore(engine_config(**config), progress=False)
    out = {req_id: [] for req_id in prompts}
    for req_id, prompt in prompts.items():
        core.add_request(request(req_id, prompt, params))
    while core.has_unfinished_requests():
        for delta in core.step():
            out[delta.req_id] += delta.new_token_ids
    return out


class Cluster:
    """Supervised worker processes (roles as given) and the client that routes to them."""

    def __init__(self, roles, *, policy: str = "recompute", worker_args=(), **config) -> None:
        self.supervisor = Supervisor(engine_config(**config), roles=roles, use_tcp=True,
                                     restart_backoff_s=(0.2, 1.0),
                                     worker_args=["--heartbeat-s", "0.2", *worker_args],
                                     env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        self.client = EngineClient(self.supervisor.address, heartbeat_timeout_s=20.0,
                                   router=Router(), handoff_failure=policy)
        self.supervisor.attach(self.client)
        self.num_workers = len(roles)

    async def start(self, timeout_s: float = 120.0) -> Cluster:
        await self.client.start()
        await self.supervisor.start()
        await until(lambda: len(self.client.workers()) == self.num_workers, timeout_s)
        return self

    def worker(self, role: str):
        return next(r for r in self.client.workers().values() if r.role == role)

    def stat(self, role: str, name: str) -> float:
        """A worker's figure by its /metrics name (duplex_worker_figure), 0 before any."""
        ready = self.worker(role)
        stats = self.client.worker_stats().get(ready.worker_id)
        return worker_figures(stats).get(name, 0.0) if stats else 0.0

    async def close(self) -> None:
        await self.supervisor.close(grace_s=3.0)
        await self.client.close()
