"""The C sampling kernel (kernels/cpu_sampler.c) against its torch reference: the same
thresholds and the same drawn tokens for the same uniforms, over logits that put the
boundary in each of the kernel's paths (shallow window, deep window, past both, top-k past
both), with masked tokens, ties, temperatures and odd vocabulary sizes."""
from __future__ import annotations

import pytest
import torch

from duplex.kernels import cpu_sampler

pytestmark = pytest.mark.skipif(not cpu_sampler.available(), reason="no C compiler")


def params(n: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.long),
            torch.full((n,), top_p, dtype=torch.float64),
            torch.full((n,), min_p, dtype=torch.float64),
            torch.rand(n, generator=gen, dtype=torch.float64))


def logits_of(kind: str, n: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=gen)
    if kind == "peaked":  # a language model's: a few tokens far above a bulk
        heads = torch.randint(0, vocab, (n, 6), generator=gen)
        return (x * 2).scatter(1, heads, 14 + 2 * torch.randn(n, 6, generator=gen))
    if kind == "flat":  # a nucleus of thousands
        return x * 0.5
    if kind == "spread":  # values 0..100 below the max: the boundary in the deep window or past it
        return -100 * torch.rand(n, vocab, generator=gen)
    if kind == "tied":
        return (x * 4).round() / 2
    if kind == "masked":  # most tokens ruled out, as by a grammar
        keep = torch.rand(n, vocab, generator=gen) < 0.01
        keep[:, 0] = True
        return torch.where(keep, x * 3, float("-inf"))
    raise ValueError(kind)


CASES = [dict(), dict(top_p=0.95), dict(top_p=0.5, temperature=0.7), dict(top_k=1),
         dict(top_k=40), dict(top_k=40, top_p=0.9, min_p=0.05), dict(min_p=0.1),
         dict(top_p=0.999999), dict(top_k=3000, top_p=0.99, temperature=1.5),
         dict(top_p=1.0 - 1e-9),  # in 'spread', the boundary ~21 below the max: window 2
         dict(temperature=0.25, top_p=0.999)]  # most exps below -87: denormal and zero


@pytest.mark.parametrize("kind", ["peaked", "flat", "spread", "tied", "masked"])
@pytest.mark.parametrize("vocab", [4099, 8192])
def test_the_kernel_is_its_reference(kind, vocab):
    x = logits_of(kind, 4, vocab, seed=vocab)
    for case in CASES:
        args = params(4, **case, seed=len(case))
        token, threshold = cpu_sampler.sample(x, *args)
        ref_token, ref_threshold = cpu_sampler.sample_ref(x, *args)
        assert torch.equal(threshold, ref_threshold), (kind, case)
        assert torch.equal(token, ref_token), (kind, case)
        y = x / args[0][:, None]
        assert bool((y.gather(1, token[:, None])[:, 0] >= threshold).all()), "a kept token"


def test_top_k_past_both_windows():
    x = logits_of("spread", 3, 4099, seed=1)  # the 4000th largest lies ~98 below the max
    args = params(3, top_k=4000, top_p=0.9999)
    assert torch.equal(cpu_sampler.sample(x, *args)[1], cpu_sampler.sample_ref(x, *args)[1])
    args = params(3, top_k=4000)
    threshold = cpu_sampler.sample(x, *args)[1]
    assert torch.equal(threshold, cpu_sampler.sample_ref(x, *args)[1])
    assert (x.max(-1).values - threshold > 80).all()


def test_one_allowed_token_is_drawn_whatever_the_uniform():
    x = torch.full((4, 1000), float("-inf"))
    x[torch.arange(4), torch.tensor([0, 7, 500, 999])] = torch.tensor([1.0, -50.0, 3.0, 0.0])
    for case in (dict(), dict(top_p=0.5), dict(top_k=3), dict(min_p=0.5)):
        token, _ = cpu_sampler.sample(x, *params(4, **case))
        assert token.tolist() == [0, 7, 500, 999]


def test_a_row_does_not_depend_on_the_batch():
    x = logits_of("peaked", 8, 8192, seed=3)
    args = params(8, top_p=0.9, temperature=0.8)
    together = cpu_sampler.sample(x, *args)
    for row in (0, 5):
        alone = cpu_sampler.sample(x[row:row + 1], *(a[row:row + 1] for a in args))
        assert alone[0][0] == together[0][row] and alone[1][0] == together[1][row]


def test_rows_with_their_own_parameters_split_over_threads():
    """Each thread claims its next row ahead (and prefetches it): every row of an odd-sized
    batch with its own parameters gets what it gets alone."""
    x = logits_of("flat", 7, 4099, seed=5)
    gen = torch.Generator().manual_seed(5)
    args = (torch.tensor([1.0, 0.7, 1.3, 1.0, 0.9, 1.0, 0.5]),
            torch.tensor([0, 40, 0, 1, 0, 3000, 0]),
            torch.tensor([0.95, 1.0, 0.5, 1.0, 0.9, 0.99, 1.0], dtype=torch.float64),
            torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.1], dtype=torch.float64),
            torch.rand(7, generator=gen, dtype=torch.float64))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernel takes torch's thread count
    try:
        together = cpu_sampler.sample(x, *args)
    finally:
        torch.set_num_threads(threads)
    ref = cpu_sampler.sample_ref(x, *args)
    assert torch.equal(together[0], ref[0]) and torch.equal(together[1], ref[1])
    for row in range(7):
        alone = cpu_sampler.sample(x[row:row + 1], *(a[row:row + 1] for a in args))
        assert alone[0][0] == together[0][row] and alone[1][0] == together[1][row]
