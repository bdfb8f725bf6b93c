"""kernels/cpu_gguf.c's int8-activation row kernel (gg_linear_x / gg_linear_q8), each block
type straight from its bytes (AVX2 where the CPU has it), against the `gguf` package's numpy
dequantizer times x rounded to int8 the same way (per 32 inputs, K-quants per 256), in fp64.

Blocks are random bytes (every nibble, fifth / sixth bit and 6-bit scale pattern) with fp16
scale fields drawn over fp16's whole range (0, subnormal, 6e4, either sign); x has zero blocks
and rows of very different sizes. What is left between kernel and reference is fp32 rounding
of the sums (the integer dots are exact), so each output is held to a few fp32 ulps of
sum |w x| for its row and column. The same checks run on the portable C path (the library
built with AVX2 off, and with AVX off) and hold it to the AVX2 path's rounding of x. On a
CPU with AVX-512 VNNI the default build runs the K-quants' 512-bit dots (cpu_gguf.c), and
the AVX2 ones are checked from a build without AVX-512."""
from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest
import torch

from duplex.kernels import cpu_gguf
from duplex.kernels.cpu_fused import build_library

from tests.kernels.test_gguf_weight import int8_blocks, int8_rounded

BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
SCALES = np.array([0.0, 2.0 ** -24, 6.1e-5, 1e-3, 0.02, 1.0, 300.0, 65504.0], np.float32)
ROWS = (1, 2, 5, 12)  # x rows: one, the kernel's group of 4 and what is left, three groups
REL = 2e-6  # of sum |w x|: fp32 sums of at most a few hundred terms a lane (seen: 5e-7)
ROW_REL = 1e-5  # of the row's largest |output| (the other tests' 1e-4 of the largest; seen 1e-6)


def random_blocks(type_name: str, n: int, k: int, seed: int, extreme: bool) -> torch.Tensor:
    """uint8 `[n, row_bytes]` of random bytes, the fp16 fields set to finite values (from
    SCALES with random signs when extreme, else small positive ones)."""
    rng = np.random.default_rng(seed)
    _, block, nbytes = cpu_gguf.TYPES[cpu_gguf.TYPE_IDS[type_name]]
    blocks = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    for start in FP16_FIELDS[type_name]:
        if extreme:
            d = rng.choice(SCALES, size=(n, k // block)) * rng.choice([-1.0, 1.0], size=(n, k // block))
        else:
            d = rng.random((n, k // block)) * 2e-3
        blocks[..., start:start + 2] = d.astype(np.float16).view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def random_x(m: int, k: int, seed: int) -> torch.Tensor:
    """[m, k] fp32: rows scaled from 1e-6 to 1e3, a zero block, one large input a row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 3, m)[:, None]
    x[:, 32:64] = 0
    x[torch.arange(m), torch.randint(0, k, (m,), generator=g)] *= 50
    return x


def run(lib, type_name: str, raw: torch.Tensor, k: int, x: torch.Tensor, threads: int
        ) -> torch.Tensor:
    """gg_linear_x on `lib` (x may have a row stride above k)."""
    m, n = x.shape[0], raw.shape[0]
    out = torch.full((m, n), float("nan"))
    rc = lib.gg_linear_x(cpu_gguf.TYPE_IDS[type_name], raw.data_ptr(), raw.shape[1], n, k,
                         x.data_ptr(), x.stride(0), m, out.data_ptr(), n, threads)
    assert rc == 0
    return out


def check(got: torch.Tensor, w: torch.Tensor, x: torch.Tensor, type_name: str) -> None:
    """got [m, n] against x rounded to int8 as the type's kernel takes it (x_group) @ w.T in
    fp64: within REL of sum |w x| and within ROW_REL of the largest |output| of its row."""
    xr = int8_rounded(x, cpu_gguf.x_group(cpu_gguf.TYPE_IDS[type_name]))
    ref = xr @ w.double().T
    err = (got.double() - ref).abs()
    for bound in (REL * (xr.abs() @ w.double().abs().T), ROW_REL * ref.abs().amax(1, keepdim=True)):
        worst = (err / (bound + 1e-30)).max().item()
        assert worst <= 1, f"error {worst:.2f}x the bound, max err {err.max().item():.3g}"


def reference_w(type_name: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    w = cpu_gguf.reference_dequant(cpu_gguf.TYPE_IDS[type_name], raw, k)
    assert torch.isfinite(w).all()
    return w


def extreme_case(type_name: str, n: int, k: int, m: int, seed: int):
    """Random blocks with extreme scales (n rows), their reference weights, m rows of x."""
    raw = random_blocks(type_name, n, k, seed=seed, extreme=True)
    return raw, reference_w(type_name, raw, k), random_x(m, k, seed=seed)


@contextlib.contextmanager
def vnni_only(lib, lanes: bool = False, x_lanes: bool = False):
    """The library's AMX-INT8 tiles off (where it has them) for the block, the AVX-512 kernel
    with weight rows in the lanes off too unless `lanes`, and the ones with rows of x in the
    lanes (AVX-512: 5-8, 13-16, 29-32 rows; AVX2: 6 rows and more) unless `x_lanes`: by
    default the row loop only (VNNI or AVX2)."""
    if hasattr(lib, "gg_set_amx"):
        lib.gg_set_amx(0)
    if hasattr(lib, "gg_set_vn"):
        lib.gg_set_vn(1 if lanes else 0)
    if hasattr(lib, "gg_set_xl"):
        lib.gg_set_xl(1 if x_lanes else 0)
    if hasattr(lib, "gg_set_x8"):
        lib.gg_set_x8(1 if x_lanes else 0)
    try:
        yield
    finally:
        cpu_gguf.apply_amx_switch(lib)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("k", [256, 1280, 2048, 8192])  # 1280: an odd count of 256-blocks
def test_every_block_type_rows_and_threads(type_name, k):
    n = 67  # odd: the two threads' shares differ
    raw = random_blocks(type_name, n, k, seed=k, extreme=True)
    w = reference_w(type_name, raw, k)
    x = random_x(max(ROWS), k, seed=k)
    lib = cpu_gguf._load()
    with vnni_only(lib):  # the AMX tiles: test_amx_tiles
        one = run(lib, type_name, raw, k, x, threads=1)
        check(one, w, x, type_name)
        assert torch.equal(run(lib, type_name, raw, k, x, threads=2), one)
        for m in ROWS:  # each row of x alone or in any group gives the same bits
            assert torch.equal(run(lib, type_name, raw, k, x[:m].contiguous(), threads=2), one[:m])


AMX_ROWS = (8, 12, 16, 17, 33)  # the tiles' fewest rows, one group of 16 padded / full, 2, 3


@pytest.mark.skipif(not cpu_gguf.amx_available(), reason="no AMX-INT8 on this CPU (or not given)")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k", [256, 1280, 8192])
def test_amx_tiles(type_name, k):
    """K-quant rows of x from AMX_ROWS on take the AMX-INT8 tiles: held to the same bound,
    the same bits on one thread or two and for each row of x in any group of 8 or more (the
    lanes are rows of x), and not the VNNI loop's bits (so the tiles did run)."""
    n = 67  # four tasks of 16 weight rows and 3 rows of zeros padding the fifth
    raw = random_blocks(type_name, n, k, seed=k + 1, extreme=True)
    w = reference_w(type_name, raw, k)
    x = random_x(max(AMX_ROWS), k, seed=k + 1)
    lib = cpu_gguf._load()
    full = run(lib, type_name, raw, k, x, threads=1)
    check(full, w, x, type_name)
    assert torch.equal(run(lib, type_name, raw, k, x, threads=2), full)
    for m in AMX_ROWS:
        assert torch.equal(run(lib, type_name, raw, k, x[:m].contiguous(), threads=2), full[:m])
    with vnni_only(lib):
        vnni = run(lib, type_name, raw, k, x, threads=2)
    assert not torch.equal(vnni, full)


VN_ROWS = (8, 9, 12, 16, 17, 35)  # the lane kernel's fewest rows, padded to 12, a pass of 16, more


@pytest.mark.skipif(not hasattr(cpu_gguf._load() if cpu_gguf.available() else None, "gg_set_vn"),
                    reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k", [256, 1280, 8192])
def test_vnni_weight_rows_in_lanes(type_name, k):
    """K-quant rows of x from 8 on (AMX off) take the kernel with 16 weight rows in a
    register's lanes: held to the same bound, the same bits on one thread or two and for each
    row of x in any group of 8 or more (its operations are per row of x), and not the row
    loop's bits (so it did run)."""
    n = 67  # four tasks of 16 weight rows and a fifth of 3 (13 lanes of zeros)
    raw, w, x = extreme_case(type_name, n, k, max(VN_ROWS), seed=k + 2)
    lib = cpu_gguf._load()
    with vnni_only(lib, lanes=True):
        full = run(lib, type_name, raw, k, x, threads=1)
        check(full, w, x, type_name)
        assert torch.equal(run(lib, type_name, raw, k, x, threads=2), full)
        for m in VN_ROWS:
            assert torch.equal(run(lib, type_name, raw, k, x[:m].contiguous(), threads=2), full[:m])
        shifted = run(lib, type_name, raw, k, x[7:].contiguous(), threads=2)
        assert torch.equal(shifted, full[7:])
    with vnni_only(lib):
        loop = run(lib, type_name, raw, k, x, threads=2)
    assert not torch.equal(loop, full)


XL_ROWS = (5, 8, 13, 16, 29, 32)  # the x-lanes kernel's: a tile of 8 lanes, 3 of them zeros,
#                                   a full one; a tile of 16 with 3 lanes of zeros, a full one; two


@pytest.mark.skipif(not hasattr(cpu_gguf._load() if cpu_gguf.available() else None, "gg_set_xl"),
                    reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k", [256, 1280, 8192])
def test_vnni_x_rows_in_lanes(type_name, k):
    """K-quant matmuls of 5-8, 13-16 or 29-32 rows of x (AMX off) take the kernel with rows of
    x in a register's lanes (8 or 16 of them): held to the same bound, the same bits on one
    thread or two, for each row of x in any such group whatever its lane, and as the kernel
    with weight rows in the lanes (the same operations per output in the other orientation),
    so a row's bits are those of the batch-invariant path (gg_linear_lanes) there."""
    n = 67  # four tasks of 16 weight rows, then one of 3: a pass of 8 with 5 rows of zeros
    raw = random_blocks(type_name, n, k, seed=k + 3, extreme=True)
    w = reference_w(type_name, raw, k)
    x = random_x(max(XL_ROWS), k, seed=k + 3)
    lib = cpu_gguf._load()
    with vnni_only(lib, lanes=True, x_lanes=True):
        full = run(lib, type_name, raw, k, x, threads=1)
        check(full, w, x, type_name)
        assert torch.equal(run(lib, type_name, raw, k, x, threads=2), full)
        for m in XL_ROWS:
            assert torch.equal(run(lib, type_name, raw, k, x[:m].contiguous(), threads=2), full[:m])
        assert torch.equal(run(lib, type_name, raw, k, x[3:17].contiguous(), threads=2), full[3:17])
        assert torch.equal(run(lib, type_name, raw, k, x[9:15].contiguous(), threads=2), full[9:15])
        assert [m for m in range(1, 40) if cpu_gguf.xl_takes(m)] == [5, 6, 7, 8, 13, 14, 15, 16,
                                                                     29, 30, 31, 32]
    with vnni_only(lib, lanes=True):
        lanes = run(lib, type_name, raw, k, x, threads=2)
        assert not cpu_gguf.xl_takes(16)
    assert torch.equal(lanes, full)


@pytest.mark.skipif(not hasattr(cpu_gguf._load() if cpu_gguf.available() else None, "gg_set_vn"),
                    reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_vnni_lanes_streamed_outputs(type_name):
    """From 64 rows of x (VN_STREAM_ROWS), whole 16-column strips of an aligned output are
    stored past the caches: the same bits as each row alone (normal stores), the partial
    last strip and an output whose rows are not 64-byte multiples included."""
    k = 512
    x = random_x(70, k, seed=5)
    lib = cpu_gguf._load()
    with vnni_only(lib, lanes=True):
        for n in (64, 40, 72):  # whole strips; a partial strip; rows of 288 bytes
            raw = random_blocks(type_name, n, k, seed=n, extreme=True)
            full = run(lib, type_name, raw, k, x, threads=2)
            check(full, reference_w(type_name, raw, k), x, type_name)
            for start in (0, 62):
                rows = x[start:start + 8].contiguous()
                assert torch.equal(run(lib, type_name, raw, k, rows, threads=1),
                                   full[start:start + 8])


@pytest.mark.skipif(not hasattr(cpu_gguf._load() if cpu_gguf.available() else None, "gg_set_vn"),
                    reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_lanes_kernel_at_every_row_count(type_name):
    """gg_linear_lanes (int8 prompt steps): the kernel with weight rows in the lanes at any
    number of rows of x, below its decode-step minimum (8) too, so a row's bits are the same
    alone or in a batch; gg_linear_x's bits from 8 rows on, its one-row loop's not below; and
    -1 for a type it has no lanes kernel for or with the kernel switched off."""
    k, n = 1280, 35
    raw = random_blocks(type_name, n, k, seed=9, extreme=True)
    w = reference_w(type_name, raw, k)
    x = random_x(20, k, seed=9)
    lib = cpu_gguf._load()
    type_id = cpu_gguf.TYPE_IDS[type_name]

    def lanes(rows, threads=2):
        out = torch.full((rows.shape[0], n), float("nan"))
        assert lib.gg_linear_lanes(type_id, raw.data_ptr(), raw.shape[1], n, k, rows.data_ptr(),
                                   rows.stride(0), rows.shape[0], out.data_ptr(), n, threads) == 0
        return out

    with vnni_only(lib, lanes=True):
        full = lanes(x)
        check(full, w, x, type_name)
        assert torch.equal(full, run(lib, type_name, raw, k, x, threads=2))
        for start, end in ((0, 1), (3, 4), (5, 8), (2, 13), (19, 20)):
            assert torch.equal(lanes(x[start:end].contiguous(), threads=1), full[start:end])
        assert torch.equal(cpu_gguf.linear(type_id, raw, k, x[:3].contiguous(), lanes=True),
                           full[:3])
        assert not torch.equal(run(lib, type_name, raw, k, x[:1].contiguous(), threads=1), full[:1])
        q8 = random_blocks("Q8_0", n, k, seed=9, extreme=False)
        assert lib.gg_linear_lanes(cpu_gguf.TYPE_IDS["Q8_0"], q8.data_ptr(), q8.shape[1], n, k,
                                   x.data_ptr(), k, 1, full.data_ptr(), n, 1) == -1
    with vnni_only(lib):
        assert lib.gg_linear_lanes(type_id, raw.data_ptr(), raw.shape[1], n, k, x.data_ptr(), k,
                                   1, full.data_ptr(), n, 1) == -1


@pytest.fixture(scope="module")
def x8_lib():
    """A library with the AVX2 kernel with rows of x in the lanes (x8_linear): this CPU's own
    where it has AVX2 and no AVX-512 VNNI, else (a CPU with AVX-512) a build without AVX-512."""
    lib = cpu_gguf._load() if cpu_gguf.available() else None
    if lib is not None and hasattr(lib, "gg_x8_available") and lib.gg_x8_available() == 1:
        return lib
    if b" avx2" not in __import__("duplex.kernels.cpu_fused", fromlist=["x"]).cpu_flags():
        pytest.skip("no AVX2 on this CPU")
    built = cpu_gguf._declare(ctypes.CDLL(str(build_library(
        cpu_gguf._SOURCE, ["-fopenmp", "-ffp-contract=off", "-mno-avx512f"]))))
    assert built.gg_x8_available() == 1
    return built


def lanes_run(lib, type_name: str, raw: torch.Tensor, k: int, x: torch.Tensor, threads: int
              ) -> torch.Tensor:
    """gg_linear_lanes on `lib`: every row count on the lanes kernel."""
    out = torch.full((x.shape[0], raw.shape[0]), float("nan"))
    assert lib.gg_linear_lanes(cpu_gguf.TYPE_IDS[type_name], raw.data_ptr(), raw.shape[1],
                               raw.shape[0], k, x.data_ptr(), x.stride(0), x.shape[0],
                               out.data_ptr(), raw.shape[0], threads) == 0
    return out


X8_ROWS = (6, 7, 8, 13, 16, 40)  # the fewest, partial tiles, one tile, 2 tiles, 5 (prompt tasks)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k", [256, 1280, 8192])
def test_avx2_x_rows_in_lanes(x8_lib, type_name, k):
    """K-quant matmuls of 6 rows of x and more on AVX2 (no AVX-512 VNNI) take the kernel with
    8 rows of x in a register's lanes and int16 sums between the scale multiplies: held to
    the same bound as the row loop; the same bits on one thread or two, for each row alone
    or in any group through gg_linear_lanes (which prompt steps take at every row count) and
    as gg_linear_x's from 6 rows; not the row loop's bits (so the kernel did run); few tiles
    (tasks of 2 weight rows) and many (16 a task, block by block) alike."""
    lib = x8_lib
    n = 67  # odd: a task of one weight row last; 4 tasks of 16 and one of 3 with 5+ tiles
    raw, w, x = extreme_case(type_name, n, k, max(X8_ROWS), seed=k + 7)
    with vnni_only(lib, x_lanes=True):
        full = lanes_run(lib, type_name, raw, k, x, threads=1)
        check(full, w, x, type_name)
        assert torch.equal(lanes_run(lib, type_name, raw, k, x, threads=2), full)
        for m in X8_ROWS:
            assert torch.equal(run(lib, type_name, raw, k, x[:m].contiguous(), threads=2), full[:m])
        for start, end in ((0, 1), (3, 4), (5, 9), (2, 15), (39, 40)):
            assert torch.equal(lanes_run(lib, type_name, raw, k, x[start:end].contiguous(), 2),
                               full[start:end])
    with vnni_only(lib):
        loop = run(lib, type_name, raw, k, x[:16].contiguous(), threads=2)
        check(loop, w, x[:16], type_name)
        assert not torch.equal(loop, full[:16])
        assert lib.gg_linear_lanes(cpu_gguf.TYPE_IDS[type_name], raw.data_ptr(), raw.shape[1],
                                   n, k, x.data_ptr(), k, 1, full.data_ptr(), n, 1) == -1


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_avx2_x_rows_in_lanes_largest_sums(x8_lib, type_name, sign):
    """The int16 sums between vpmaddwd at their largest: every quant at its top value (Q4_K
    15, Q5_K 31, Q6_K 63), every scale and min at 63 (Q6_K's at 127) and every input at +-127
    after rounding: exact, as the reference, with no int16 overflow."""
    k, n = 512, 9
    _, block, nbytes = cpu_gguf.TYPES[cpu_gguf.TYPE_IDS[type_name]]
    blocks = np.full((n, k // block, nbytes), 0xFF, np.uint8)
    if type_name == "Q6_K":
        blocks[..., 192:208] = 127  # int8 scales
    one = np.array([1e-3], np.float16).view(np.uint8)
    for start in FP16_FIELDS[type_name]:
        blocks[..., start:start + 2] = one
    raw = torch.from_numpy(blocks.reshape(n, -1))
    w = reference_w(type_name, raw, k)
    x = torch.full((16, k), sign)
    x[8:, ::2] = -sign  # the second tile: inputs of both signs
    got = lanes_run(x8_lib, type_name, raw, k, x, threads=2)
    check(got, w, x, type_name)


def test_avx2_x_lanes_switch(x8_lib, monkeypatch):
    """DUPLEX_GGUF_X8=0 sends K-quant rows of x back to the row loop and turns gg_linear_lanes
    off on AVX2; the decode row limit (gguf_weight.row_limit) follows where this CPU's own
    library has the kernel: 96 with it, 48 without."""
    from duplex.kernels import gguf_weight

    lib = x8_lib
    type_id, k = cpu_gguf.TYPE_IDS["Q4_K"], 512
    raw = random_blocks("Q4_K", 40, k, seed=3, extreme=False)
    x = random_x(16, k, seed=3)
    with vnni_only(lib):
        loop = run(lib, "Q4_K", raw, k, x, threads=2)
    own = lib is cpu_gguf._load()
    monkeypatch.setenv("DUPLEX_GGUF_X8", "0")
    cpu_gguf.apply_amx_switch(lib)
    try:
        assert lib.gg_x8_available() == 0
        assert torch.equal(run(lib, "Q4_K", raw, k, x, threads=2), loop)
        if own:
            assert not cpu_gguf.x8_available() and not cpu_gguf.lanes_available()
            assert gguf_weight.row_limit(type_id) == gguf_weight.GEMV_ROWS * gguf_weight.K_QUANT_ROW_FACTOR
    finally:
        monkeypatch.delenv("DUPLEX_GGUF_X8")
        cpu_gguf.apply_amx_switch(lib)
    assert lib.gg_x8_available() == 1
    assert not torch.equal(run(lib, "Q4_K", raw, k, x, threads=2), loop)
    if own and not cpu_gguf.amx_available():
        assert cpu_gguf.lanes_available() and gguf_weight.row_limit(type_id) == 96


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_odd_count_of_32_blocks(type_name):
    """k = 9 x 32: the 32-block loop's two accumulators and its last block alone."""
    k, n = 288, 33
    raw = random_blocks(type_name, n, k, seed=5, extreme=False)
    x = random_x(5, k, seed=5)
    for threads in (1, 2):
        check(run(cpu_gguf._load(), type_name, raw, k, x, threads), reference_w(type_name, raw, k), x,
              type_name)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_linear_and_the_two_step_entry_agree(type_name):
    """cpu_gguf.linear (gg_linear_x, one call) and quantize_x + gg_linear_q8 give the same
    bits, also for x rows with a stride above k."""
    k, n, m = 512, 40, 5
    raw = random_blocks(type_name, n, k, seed=3, extreme=False)
    wide = random_x(m, k + 64, seed=3)
    x = wide[:, 16:16 + k]
    assert x.stride(0) == k + 64
    got = cpu_gguf.linear(cpu_gguf.TYPE_IDS[type_name], raw, k, x)
    xq, dx, xs = cpu_gguf.quantize_x(x, cpu_gguf.x_group(cpu_gguf.TYPE_IDS[type_name]))
    out = torch.empty(m, n)
    assert cpu_gguf._load().gg_linear_q8(
        cpu_gguf.TYPE_IDS[type_name], raw.data_ptr(), raw.shape[1], n, k, xq.data_ptr(),
        dx.data_ptr(), xs.data_ptr(), m, out.data_ptr(), n, 2) == 0
    assert torch.equal(got, out)
    check(got, reference_w(type_name, raw, k), x, type_name)


def test_rounding_ties_and_signs():
    """x exactly halfway between integers (after the scale) rounds to even, as torch does."""
    x = torch.zeros(2, 64)
    x[0, :32] = torch.arange(-15.5, 16.5)  # max 15.5: scale 127 / 15.5 (no ties)
    x[1, :32] = torch.tensor([127.0] + [i + 0.5 for i in range(-60, -30)] + [-127.0])
    x[1, 32:] = torch.linspace(-3, 3, 32)
    xq, dx, xs = cpu_gguf.quantize_x(x)
    q, scale = int8_blocks(x)
    assert torch.equal(xq.reshape(2, -1, 32).float(), q) and torch.equal(dx, scale[..., 0])
    assert xq[1, 1].item() == -60 and xq[1, 2].item() == -58  # -59.5 and -58.5 to even
    assert torch.equal(xs, xq.reshape(2, -1, 16).sum(-1, dtype=torch.int32))


@pytest.fixture(scope="module", params=[["-mno-avx512f"], ["-mno-avx2"], ["-mno-avx"]],
                ids=["avx2", "no-avx2", "no-avx"])
def portable(request):
    """The library built without AVX-512 (on a CPU with it: the AVX2 K-quant dots, which the
    default build there replaces), without AVX2 (the plain C dots), and without AVX at all
    (no F16C either: fp16 by its bits)."""
    return cpu_gguf._declare(ctypes.CDLL(str(build_library(
        cpu_gguf._SOURCE, ["-fopenmp", *request.param]))))


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_portable_path(portable, type_name):
    k, n = 1280, 35
    raw = random_blocks(type_name, n, k, seed=11, extreme=True)
    x = random_x(5, k, seed=11)
    for threads in (1, 2):
        check(run(portable, type_name, raw, k, x, threads), reference_w(type_name, raw, k), x,
              type_name)
    group = cpu_gguf.x_group(cpu_gguf.TYPE_IDS[type_name])
    xq, dx, xs = (torch.empty(5, k, dtype=torch.int8), torch.empty(5, k // group),
                  torch.empty(5, k // 16, dtype=torch.int32))
    assert portable.gg_quantize_x(x.data_ptr(), k, 5, k, group, xq.data_ptr(), dx.data_ptr(),
                                  xs.data_ptr()) == 0
    assert all(torch.equal(a, b) for a, b in zip((xq, dx, xs), cpu_gguf.quantize_x(x, group)))
    dense = torch.empty(n, k)
    assert portable.gg_dequant(cpu_gguf.TYPE_IDS[type_name], raw.data_ptr(), raw.shape[1], n,
                               k, dense.data_ptr(), k, 1) == 0
    assert torch.equal(dense, reference_w(type_name, raw, k))
    tiles = torch.empty(n, k, dtype=torch.bfloat16)
    assert portable.gg_dequant_bf16(cpu_gguf.TYPE_IDS[type_name], raw.data_ptr(), raw.shape[1],
                                    n, k, tiles.data_ptr(), k, 2) == 0
    assert torch.equal(tiles, dense.to(torch.bfloat16))


@pytest.mark.parametrize("blocks, n, size, m", [
    (8, 8192, 64, 512),   # a 1B FFN weight's 512 prompt rows
    (1, 2048, 64, 37),    # one block, part of it
    (3, 100, 64, 150),    # columns past the 16-wide tiles, the last block partial
    (2, 48, 128, 200),
    (1, 17, 64, 1),
    (4, 2048, 48, 190)])  # a block size that is not a multiple of the tiles' 32 rows
def test_unblock_bf16_is_torchs_transposed_copy(blocks, n, size, m):
    """The bf16 GEMM's [block, N, row] output into [M, N] rows: bitwise torch's transpose,
    reshape and contiguous copy (which it replaces: 1.7 against 0.65 ms at 512 x 8192)."""
    x = torch.randn(blocks, n, size, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    want = x.transpose(1, 2).reshape(blocks * size, n)[:m].contiguous()
    assert torch.equal(cpu_gguf.unblock_bf16(x, m), want)


GEMM_ROWS = (1, 16, 17, 31, 32, 33, 100)  # a row, one tile of rows, padded, a pair, past it


@pytest.mark.skipif(cpu_gguf.bf16_gemm_kind() is None,
                    reason="no AMX-BF16 or AVX512-BF16 on this CPU (or not given)")
@pytest.mark.parametrize("type_name, k", [("Q4_K", 1280), ("Q6_K", 768), ("Q5_K", 512),
                                          ("Q4_0", 608), ("Q8_0", 96), ("F16", 544),
                                          ("BF16", 64)])
def test_bf16_gemm(type_name, k):
    """The prompt GEMM on the file's blocks (gg_gemm_bf16: AMX-BF16 tiles or AVX512-BF16,
    whichever this CPU runs): x and the dequantized weights in bf16, fp32 sums rounded once.
    k covers one input slice, a slice and a part, and parts of a K-quant block; n = 300 is
    two AMX panels, the second 44 rows (a pair of 16-row groups and a half-empty one), and
    nine AVX-512 panels of 32 rows and one of 12. Each row's output is the same bits whatever
    the row count (1 to 100 rows: whole, part and single blocks of 12 rows; from another row
    than the first; 1100: two AMX passes), on one thread or two, and for rows with a stride."""
    n = 300
    raw = random_blocks(type_name, n, k, seed=k, extreme=False) if cpu_gguf.TYPES[
        cpu_gguf.TYPE_IDS[type_name]][1] > 1 else _float_rows(type_name, n, k)
    type_id = cpu_gguf.TYPE_IDS[type_name]
    w = cpu_gguf.dequant(type_id, raw, k, dtype=torch.bfloat16).double()
    assert torch.equal(w, reference_w(type_name, raw, k).to(torch.bfloat16).double())
    wide = random_x(max(GEMM_ROWS), k + 32, seed=k).to(torch.bfloat16)
    x = wide[:, 16:16 + k]  # rows with a stride above k
    full = cpu_gguf.gemm_bf16(type_id, raw, k, x)
    assert full is not None and full.dtype == torch.bfloat16 and full.shape == (x.shape[0], n)
    ref = x.double() @ w.T
    err = (full.double() - ref).abs()
    bound = 2.0 ** -8 * ref.abs() + 1e-6 * (x.double().abs() @ w.abs().T) + 1e-30
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f}x the bound"
    for m in GEMM_ROWS:
        torch.set_num_threads(1 + m % 2)
        try:
            assert torch.equal(cpu_gguf.gemm_bf16(type_id, raw, k, x[:m].contiguous()), full[:m])
        finally:
            torch.set_num_threads(2)
    assert torch.equal(cpu_gguf.gemm_bf16(type_id, raw, k, x[5:40]), full[5:40])  # other lanes
    many = x.repeat(11, 1)[:1100]
    assert torch.equal(cpu_gguf.gemm_bf16(type_id, raw, k, many)[1000:1100], full)


def _float_rows(type_name: str, n: int, k: int) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
    w = w.to(torch.float16 if type_name == "F16" else torch.bfloat16)
    return w.view(torch.uint8).reshape(n, -1).contiguous()


def test_bf16_gemm_switches(monkeypatch):
    """DUPLEX_GGUF_AMX=0 turns the AMX-BF16 prompt GEMM off with the AMX-INT8 tiles, and
    DUPLEX_GGUF_BF16_GEMM=0 the AVX512-BF16 one: with both off, gemm_bf16 declines (the
    caller's dequantized chunks and oneDNN take the product)."""
    lib = cpu_gguf._load()
    if cpu_gguf.bf16_gemm_kind() is None:
        pytest.skip("no bf16 GEMM kernel on this CPU")
    raw = random_blocks("Q4_K", 16, 256, seed=1, extreme=False)
    x = torch.ones(3, 256, dtype=torch.bfloat16)
    monkeypatch.setenv("DUPLEX_GGUF_AMX", "0")
    cpu_gguf.apply_amx_switch(lib)
    try:
        assert not cpu_gguf.amx_bf16_available()
        assert cpu_gguf.bf16_gemm_kind() in (None, "avx512")
        monkeypatch.setenv("DUPLEX_GGUF_BF16_GEMM", "0")
        cpu_gguf.apply_amx_switch(lib)
        assert cpu_gguf.bf16_gemm_kind() is None
        assert cpu_gguf.gemm_bf16(cpu_gguf.TYPE_IDS["Q4_K"], raw, 256, x) is None
    finally:
        monkeypatch.delenv("DUPLEX_GGUF_AMX")
        monkeypatch.delenv("DUPLEX_GGUF_BF16_GEMM", raising=False)
        cpu_gguf.apply_amx_switch(lib)
    assert cpu_gguf.gemm_bf16(cpu_gguf.TYPE_IDS["Q4_K"], raw, 256, x) is not None


def test_vn16_switch(monkeypatch):
    """DUPLEX_GGUF_VN16=0 sends K-quant rows of 8 or more (AMX off) back to the row loop, and
    the decode row limit (gguf_weight.row_limit) follows: 96 with the lane kernel, 48 without."""
    from duplex.kernels import gguf_weight

    lib = cpu_gguf._load()
    if not hasattr(lib, "gg_set_vn"):
        pytest.skip("built without AVX-512 VNNI")
    type_id, k = cpu_gguf.TYPE_IDS["Q4_K"], 512
    raw = random_blocks("Q4_K", 40, k, seed=3, extreme=False)
    x = random_x(16, k, seed=3)
    with vnni_only(lib):
        loop = run(lib, "Q4_K", raw, k, x, threads=2)
    with vnni_only(lib, lanes=True):
        lanes = run(lib, "Q4_K", raw, k, x, threads=2)
    assert not torch.equal(loop, lanes)
    monkeypatch.setenv("DUPLEX_GGUF_VN16", "0")
    monkeypatch.setenv("DUPLEX_GGUF_XL16", "0")
    monkeypatch.setenv("DUPLEX_GGUF_AMX", "0")
    cpu_gguf.apply_amx_switch(lib)
    try:
        assert not cpu_gguf.vn_available()
        assert gguf_weight.row_limit(type_id) == gguf_weight.GEMV_ROWS * gguf_weight.K_QUANT_ROW_FACTOR
        assert torch.equal(run(lib, "Q4_K", raw, k, x, threads=2), loop)
    finally:
        monkeypatch.delenv("DUPLEX_GGUF_VN16")
        monkeypatch.delenv("DUPLEX_GGUF_XL16")
        monkeypatch.delenv("DUPLEX_GGUF_AMX")
        cpu_gguf.apply_amx_switch(lib)
    if not cpu_gguf.amx_available():
        assert cpu_gguf.vn_available() and gguf_weight.row_limit(type_id) == 96
        x40 = torch.cat([x, random_x(24, k, seed=4)])  # 40 rows: past the x-lanes kernel's 32
        assert torch.equal(run(lib, "Q4_K", raw, k, x40, threads=2)[:16], lanes)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_fp32_activations_path(type_name):
    """linear(..., fp32_x=True), what a GGUF head's rows take in a prompt step: each weight
    row dequantized (bitwise gguf's values) and dotted with x in fp32, so its outputs are the
    fp64 reference's up to fp32 sums, with no int8 rounding of x."""
    k, n = 1280, 37
    raw = random_blocks(type_name, n, k, seed=5, extreme=False)
    w = reference_w(type_name, raw, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    got = cpu_gguf.linear(cpu_gguf.TYPE_IDS[type_name], raw, k, x, fp32_x=True)
    ref = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((got.double() - ref).abs() <= bound).all()
    int8 = cpu_gguf.linear(cpu_gguf.TYPE_IDS[type_name], raw, k, x)
    assert ((int8.double() - ref).abs() > bound).any()  # the int8 path is measurably coarser


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 40])  # the row loop, xl_linear, vn_linear (2m rows)
def test_split_activations_path(type_name, m):
    """linear(..., split_x=True), what a GGUF head's rows take in a prompt step: x in two int8
    parts, the second the first's rounding error quantized again, so each input is off by at
    most max|x| / (127 * 508) over its group (1/64516), and each output by that times
    sum |w| on top of the fp32 sums' rounding. int8 alone (one part) breaks that bound."""
    k, n = 1280 if cpu_gguf.TYPES[cpu_gguf.TYPE_IDS[type_name]][1] == 32 else 1536, 37
    raw = random_blocks(type_name, n, k, seed=6, extreme=False)
    w = reference_w(type_name, raw, k).double()
    x = random_x(m, k, seed=6)
    group = 256 if cpu_gguf.TYPES[cpu_gguf.TYPE_IDS[type_name]][1] == 256 else 32
    amax = x.double().abs().reshape(m, k // group, group).amax(-1).repeat_interleave(group, 1)
    ref = x.double() @ w.T
    bound = (amax @ w.abs().T) / 64516 * 1.001 + 4 * REL * (x.double().abs() @ w.abs().T) + 1e-30
    got = cpu_gguf.linear(cpu_gguf.TYPE_IDS[type_name], raw, k, x, split_x=True)
    assert ((got.double() - ref).abs() <= bound).all()
    int8 = cpu_gguf.linear(cpu_gguf.TYPE_IDS[type_name], raw, k, x)
    assert ((int8.double() - ref).abs() > bound).any()


@pytest.mark.skipif(not hasattr(cpu_gguf._load() if cpu_gguf.available() else None,
                                "gg_set_kq_prefetch"), reason="built without the AVX2 row kernel")
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_row_kernel_prefetch_changes_no_bit(name):
    """DUPLEX_GGUF_KQ_PREFETCH: kq_rows' prefetch of the next blocks at one row of x (past
    a row's end into the next row, and past the last row's end) only moves bytes into the
    cache; one row of x gives the same outputs with it on and off, and they are the weights'
    own (gguf's dequantization, x as the kernel rounds it)."""
    lib = cpu_gguf._load()
    k, n = 256 * 9, 37  # more blocks than the prefetch distance, an odd weight row at the end
    raw = random_blocks(name, n, k, seed=5, extreme=False)
    x = random_x(1, k, seed=6)
    outs = []
    for on in (1, 0):
        lib.gg_set_kq_prefetch(on)
        try:
            outs.append(run(lib, name, raw, k, x, threads=2))
        finally:
            cpu_gguf.apply_amx_switch(lib)
    assert torch.equal(outs[0], outs[1])
    check(outs[0], cpu_gguf.reference_dequant(cpu_gguf.TYPE_IDS[name], raw, k), x, name)
