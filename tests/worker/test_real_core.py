"""The whole path with the real engine: Supervisor -> `python -m duplex.engine.worker_cli` loading the
default model -> EngineClient. Slow on CPU (model load and warm-up take tens of seconds)."""
from __future__ import annotations

import importlib.util

import pytest

from duplex.engine.config import DEFAULT_MODEL_PACKAGE, EngineConfig
from duplex.engine.messages import AddRequest
from duplex.engine.sampling_params import SamplingParams
from duplex.frontend.engine_client import EngineClient
from duplex.frontend.supervisor import Supervisor

from .conftest import REPO, collect, tokens

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("duplex.engine.core") is None, reason="no engine.core"),
    pytest.mark.skipif(importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None,
                       reason="default model not installed"),
]

PROMPT = [1, 2, 3, 4]
# Greedy continuation of PROMPT by an in-process float32 EngineCore on the default model.
EXPECTED = [79, 100, 43405, 198, 198, 57, 5248, 253]


async def test_default_model_generates_through_a_worker_process():
    supervisor = Supervisor(EngineConfig.of(num_kv_blocks=64, max_model_len=512,
                                         weights_dtype="float32"),
                            env={"PYTHONPATH": str(REPO)})
    client = EngineClient(supervisor.addresses[0], heartbeat_timeout_s=30.0)
    supervisor.attach(client)
    await client.start()
    await supervisor.start()
    try:
        ready = await client.wait_ready(240)
        assert (ready.role, ready.block_size, ready.num_kv_blocks) == ("unified", 16, 64)
        assert ready.weights == "float32" and ready.num_threads >= 1  # cores it may use
        deltas = await collect(client, AddRequest(
            "greedy", PROMPT, SamplingParams(temperature=0, max_tokens=8)))
        assert tokens(deltas) == EXPECTED
        assert [d.finish_reason for d in deltas][-1] == "length"
        assert deltas[0].num_prompt_tokens == len(PROMPT)
    finally:
        await supervisor.close()
        await client.close()
