"""Batch-invariant mode: one process-wide switch and CPU implementations whose result for a row
(a token) is bitwise the same whatever else is in the batch."""
import torch

from kernels import attention, matmul, rms_norm

_enabled = False


def is_batch_invariant() -> bool:
    return _enabled


class set_batch_invariant_mode:
    """Turn the mode on (or off) process-wide, now. Used as a context manager it restores the
    previous setting on exit: `with set_batch_invariant_mode(): ...`. Process-wide rather than
    thread-local because the engine runs its forward pass in an executor thread."""

    def __init__(self, enabled: bool = True):
        global _enabled
        self._previous = _enabled
        _enabled = enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        global _enabled
        _enabled = self._previous
