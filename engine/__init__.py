"""Duplex engine: `from engine import LLM, SamplingParams`."""
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing engine.messages must not load torch
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
