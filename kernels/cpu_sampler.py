"""Batched truncation and draws (kernels/cpu_sampler.c), and their torch reference.

    sample(x, temperature, top_k, top_p, min_p, uniform)      -> (token [n], threshold [n])
    sample_packed(x, params)                                   the same, params [n, 5] f64
    sample_ref(...)                                            the same, in torch, any device

Rows of logits x [n, vocab] fp32, per-row parameters: temperature (fp32), top_k (0: off),
top_p (>= 1: off), min_p (0: off), and a uniform in [0, 1) for the draw (None: thresholds
only). With y = x / temperature, m = max y and e = exp(y - m) (in fp32; every sum of e in
fp64), a row keeps y >= threshold, the largest of:

    top-k  the k-th largest y (ties at the k-th kept)
    top-p  the smallest y whose top-k-kept mass strictly above it is < top_p * (their total)
    min-p  the smallest y with e >= min_p

and draws token i with probability e_i / (the kept tokens' sum) by inverse CDF. The kept set
is defined by values, not positions (float64 sums), so a tied group is kept or dropped whole
and a sort's order never decides; the kernel and the reference agree except where a row's
boundary lies within rounding of top_p (the sums run in different orders, and the two
vector exps may differ in the last bit). The C kernel buckets each row by depth below its max
instead of sorting it (O(vocab) per row) and splits rows over threads; each row's result is
independent of the batch.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from duplex.kernels.cpu_fused import load_library

_SOURCE = Path(__file__).with_name("cpu_sampler.c")
_lib: ctypes.CDLL | None | bool = None
_P, _I = ctypes.c_void_p, ctypes.c_int64
NUM_PARAMS = 5  # per row: temperature, top_k, top_p, min_p, uniform


def available() -> bool:
    return _load() is not False


def fits(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2


def sample(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor,
           uniform: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernel: -> (token [n] int64, undefined without uniform; threshold [n] fp32)."""
    args = _params(x.shape[0], temperature, top_k, top_p, min_p, uniform)
    return sample_packed(x, torch.stack([a.double() for a in args], dim=1).numpy())


def sample_packed(x: torch.Tensor, params) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernel on one parameter array, params [n, 5] fp64 (a tensor or a numpy array):
    per row temperature, top_k, top_p, min_p and uniform (< 0: no draw), as in sample(); what
    the engine's Sampler builds, one buffer a call. The outputs are numpy buffers viewed as
    tensors: no torch op runs here beyond the logits' contiguity check."""
    assert fits(x), "fp32 [n, vocab] CPU logits"
    n, vocab = x.shape
    if not x.is_contiguous():
        x = x.contiguous()
    params = np.ascontiguousarray(params, dtype=np.float64)
    assert params.shape == (n, NUM_PARAMS), "five parameters per row"
    token = np.zeros(n, dtype=np.int64)
    threshold = np.empty(n, dtype=np.float32)
    rc = _load().sample_rows(x.data_ptr(), n, vocab, params.ctypes.data, token.ctypes.data,
                             threshold.ctypes.data, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("sample_rows: out of memory")
    return torch.from_numpy(token), torch.from_numpy(threshold)


def sample_ref(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, min_p: torch.Tensor,
               uniform: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, batched in torch on x's device: sorts each row."""
    n, vocab = x.shape
    temperature, top_k, top_p, min_p, _ = (t.to(x.device) for t in _params(
        n, temperature, top_k, top_p, min_p, None))
    y = x / temperature[:, None]
    s = torch.sort(y, dim=-1, descending=True).values  # [n, vocab]
    m = s[:, :1]
    e = torch.exp(s - m).double()  # [n, vocab]: the exp in fp32, every sum in fp64
    last = vocab - 1
    has_k = (top_k > 0) & (top_k < vocab)
    kth = s.gather(1, (top_k - 1).clamp(0, last)[:, None])[:, 0]
    tau_k = torch.where(has_k, kth, float("-inf"))
    ek = torch.where(s >= tau_k[:, None], e, 0.0)
    total = ek.sum(-1, keepdim=True)
    first = torch.searchsorted(-s, -s)  # each value's first position: its tied group's start
    above = (ek.cumsum(-1) - ek).gather(1, first)  # mass strictly above each value
    keep_p = (above < top_p.double()[:, None] * total) & (s >= tau_k[:, None])
    tau_p = torch.where(top_p < 1, s.gather(1, (keep_p.sum(-1) - 1).clamp(0, last)[:, None])[:, 0],
                        float("-inf"))
    keep_m = e >= min_p.double()[:, None]
    tau_m = torch.where(min_p > 0, s.gather(1, (keep_m.sum(-1) - 1).clamp(0, last)[:, None])[:, 0],
                        float("-inf"))
    threshold = torch.maximum(torch.maximum(tau_k, tau_p), tau_m)
    token = torch.zeros(n, dtype=torch.long, device=x.device)
    if uniform is not None:
        w = torch.where(y >= threshold[:, None], torch.exp(y - m).double(), 0.0)
        cdf = w.cumsum(-1)
        target = uniform.to(x.device).double()[:, None] * cdf[:, -1:]
        token = torch.minimum((cdf <= target).sum(-1), (cdf < cdf[:, -1:]).sum(-1))
    return token, threshold


def _params(n: int, temperature, top_k, top_p, min_p, uniform) -> list[torch.Tensor]:
    """The per-row parameters in the kernel's dtypes, contiguous, length n each."""
    out = [temperature.float(), top_k.long(), top_p.double(), min_p.double(),
           uniform.double() if uniform is not None else torch.full((n,), -1.0,
                                                                   dtype=torch.float64)]
    for t in out:
        assert t.shape == (n,), "one parameter per row"
    return [t.contiguous() for t in out]


def _load():
    global _lib
    if _lib is None:
        _lib = load_library(_SOURCE, ["-fopenmp", "-ffp-contract=off"], (), _declare,
                            "CPU sampling kernel")
    return _lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.sample_rows.restype = ctypes.c_int
    lib.sample_rows.argtypes = [_P, _I, _I, _P, _P, _P, ctypes.c_int]
    return lib
