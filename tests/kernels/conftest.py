"""Kernel tests run triton kernels on CUDA when present, else in triton's interpreter on CPU
(kernels._triton sets TRITON_INTERPRET=1 before triton is imported when CUDA is absent)."""
import pytest
import torch

import duplex.kernels._triton  # noqa: F401  (sets the interpreter flag first)

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def device():
    """Where triton kernels run in the small tests: CUDA, or CPU under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
