"""Engine test fixtures: the default model loaded once, tiny random models, references."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from duplex.engine import core as core_module
from duplex.engine.config import EngineConfig, default_model_path
from duplex.engine.core import EngineCore
from duplex.engine.messages import AddRequest
from duplex.engine.models import loader


@functools.lru_cache(maxsize=4)
def _cached_load(path, dtype, progress=True, quant="none"):
    return loader.load(path, dtype, progress=False, quant=quant)


@pytest.fixture(autouse=True)
def _reuse_loaded_weights(monkeypatch):
    """Weights are read-only in the engine, so tests share one load per model file."""
    monkeypatch.setattr(core_module, "load", _cached_load)


@pytest.fixture(scope="session")
def default_model() -> str:
    return default_model_path()


@functools.lru_cache(maxsize=2)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """Reference greedy decode with transformers (no EOS stop): tokens and their logprobs."""
    ids = torch.tensor([prompt_ids])
    out = model(ids, use_cache=True)
    past, tokens, logprobs = _cache_of(out), [], []
    logits = out.logits[0, -1]
    for _ in range(num_new):
        lp = torch.log_softmax(logits.float(), -1)
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(lp[token]))
        out = model(torch.tensor([[token]]), cache=past, use_cache=True)
        past, logits = _cache_of(out), out.logits[0, -1]
    return tokens, logprobs


def run_engine(core: EngineCore, prompts: list[list[int]], params, arrivals=None) -> dict:
    """Add prompts (all at once, or prompt i before step arrivals[i]) and step to the end."""
    outs = {f"r{i}": [] for i in range(len(prompts))}
    logprobs = {f"r{i}": [] for i in range(len(prompts))}
    arrivals = arrivals or [0] * len(prompts)
    step = 0
    while True:
        for i, a in enumerate(arrivals):
            if a == step:
                core.add_request(AddRequest(f"r{i}", prompts[i], params))
        if not core.has_unfinished_requests() and step > max(arrivals):
            break
        for d in core.step():
            outs[d.req_id] += d.new_token_ids
            logprobs[d.req_id] += [lp.logprob for lp in d.logprobs]
        step += 1
    return {k: (outs[k], logprobs[k]) for k in outs}


def make_core(model: str, **kwargs) -> EngineCore:
    """An engine on `model`, float32 unless told otherwise (the exact mode: references are
    transformers' fp32 outputs)."""
    kwargs.setdefault("weights_dtype", "float32")
    return EngineCore(EngineConfig.of(model=model, **kwargs), progress=False)


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
