"""Every C kernel of kernels/ compiles on this machine where it has a C compiler. A library that
fails to build only logs a warning at run time (the engine falls back to torch's kernels), and
the tests of the fast paths skip where their library is unavailable, so a compile error, such
as two included files defining one name (cpu_decode.c includes four others), would otherwise
pass CI unnoticed and only show as a slower engine."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from duplex.kernels import cpu_fused

SOURCES = sorted(p.name for p in (Path(cpu_fused.__file__).parent).glob("*.c"))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("source", SOURCES)
def test_c_library_builds(source):
    path = Path(cpu_fused.__file__).parent / source
    built = cpu_fused.build_library(path, ["-fopenmp", "-ffp-contract=off"], ("-lmvec",))
    assert built.is_file() and built.stat().st_size > 0


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("isa", [["-mno-avx512f"], ["-mno-avx2"], ["-mno-avx"]],
                         ids=["avx2", "avx", "sse"])
def test_the_one_call_decode_builds_for_older_cpus(isa):
    """cpu_decode.c includes every kernel file; built as for a CPU without AVX-512 (most
    laptops), without AVX2, or without AVX, each file's fallback branches must compile too,
    though this machine's own build never takes them."""
    path = Path(cpu_fused.__file__).parent / "cpu_decode.c"
    built = cpu_fused.build_library(path, ["-fopenmp", "-ffp-contract=off", *isa], ("-lmvec",))
    assert built.is_file() and built.stat().st_size > 0
