"""Duplex: an LLM serving engine. The one top-level import name of the project.

The repository keeps the folders it is known by (`engine/ frontend/ kvstore/ kernels/ bench/
web/` at its root); this folder maps each of them into the namespace by a relative symlink,
so `duplex.engine` is `engine/` whether the code runs from a checkout, an editable install or
a wheel (where the links are followed and the files copied). The root folders have no
`__init__.py` of their own: with the repository root on `sys.path` (pytest, `python -m`,
`python -c`) `kernels`, `engine`, `frontend` and `bench` are at most namespace portions, which
lose to any installed package of that name (Hugging Face's `kernels`, which transformers
imports, among them).

    from duplex import LLM, SamplingParams
"""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    """Lazy: `duplex chat` (duplex.frontend) must load neither torch nor the engine."""
    if name == "LLM":
        from duplex.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from duplex.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'duplex' has no attribute {name!r}")
