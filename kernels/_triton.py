"""The one place that imports triton.

Triton is optional: a CPU-only install runs every op through its torch reference. When triton
is missing, `triton.jit` becomes a no-op decorator and `tl.constexpr` a plain marker, so the
kernel modules still import; their launchers refuse to run (`require_triton`). Without CUDA,
kernels run in triton's interpreter on CPU tensors; `kernels.ops` never sends CPU tensors to
triton, except inside `on_cpu` (tests: the engine's device kernel path on the CPU).
"""
import contextlib
import os

import torch

# Without CUDA triton can only interpret CPU tensors, which tests do (tests/conftest.py sets
# TRITON_INTERPRET=1 before anything imports this); a CPU server or `generate` never runs a
# triton kernel, so it skips the import and its ~70 MB of RSS.
WANTED = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"

HAS_TRITON = False
if WANTED:
    try:
        import triton
        import triton.language as tl
        HAS_TRITON = True
    except ImportError:  # installs without triton
        pass

if not HAS_TRITON:  # installs without triton; CPU runs outside the tests
    class _MissingTriton:
        constexpr = object  # only ever used as an annotation

        @staticmethod
        def jit(fn=None, **kwargs):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _MissingTriton()


def is_interpreter() -> bool:
    """True under TRITON_INTERPRET=1: kernels then run on CPU tensors (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_on_cpu = False  # set by `on_cpu`: kernels.ops sends CPU tensors to the triton kernels


def runs_triton(t: torch.Tensor) -> bool:
    """Whether kernels.ops runs its triton kernel for a tensor: on CUDA, or on the CPU inside
    `on_cpu` (the interpreter)."""
    return t.is_cuda or _on_cpu


@contextlib.contextmanager
def on_cpu():
    """Inside it, kernels.ops runs the device path's triton kernels on CPU tensors, through
    triton's interpreter: the engine's GPU kernel path, checked end to end without a GPU
    (tests; far too slow to serve with)."""
    global _on_cpu
    if not (HAS_TRITON and is_interpreter()):
        raise RuntimeError("triton on CPU tensors needs triton and TRITON_INTERPRET=1")
    was, _on_cpu = _on_cpu, True
    try:
        yield
    finally:
        _on_cpu = was


def require_triton(*tensors) -> None:
    """Launcher precondition: triton is importable and every tensor is on a device it can run on."""
    assert HAS_TRITON, "triton is not installed; use the torch reference (kernels.ops does this)"
    for t in tensors:
        assert t.is_cuda or is_interpreter(), (
            f"tensor on {t.device} but triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 for CPU tests)")
