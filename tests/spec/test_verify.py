"""Verification: greedy cases, and invariant 7 for sampling — rejection sampling keeps the
target distribution exactly (chi-square over many seeds), while the deliberately wrong rule
is caught by the same test (negative control)."""
from __future__ import annotations

import pytest
import torch

from duplex.engine.sampling_params import SamplingParams
from duplex.engine.spec.verify import target_probs, verify_greedy, verify_sampled

P = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.07, 0.05, 0.03], dtype=torch.float64)
Q = torch.tensor([0.03, 0.05, 0.07, 0.10, 0.10, 0.15, 0.20, 0.30], dtype=torch.float64)
NUM_DRAFTS = 3
NUM_SEEDS = 3000
SEQ_LEN = 3
CRITICAL = 0.001  # p-value below which the distribution is rejected


# ---------------------------------------------------------------------- greedy
@pytest.mark.parametrize("drafts, targets, tokens, num_accepted", [
    ([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7], 3),  # all accepted, then the bonus
    ([4, 5, 6], [4, 9, 6, 7], [4, 9], 1),  # second rejected: its correction ends the run
    ([4, 5, 6], [1, 5, 6, 7], [1], 0),  # first rejected
    ([], [3], [3], 0),  # nothing drafted: plain decoding
])
def test_greedy_keeps_the_matching_prefix_and_one_more(drafts, targets, tokens, num_accepted):
    verified = verify_greedy(targets, drafts)
    assert verified.token_ids == tokens
    assert verified.num_accepted == num_accepted


# ---------------------------------------------------------------------- sampling
def _speculative_sequence(seed: int, rule: str, point_mass: bool) -> list[int]:
    """SEQ_LEN tokens from a context-free target P, drafted from Q by a model drafter, or
    (point_mass) fixed tokens drawn from P, as a good n-gram drafter would propose, with
    no distribution of their own; verified round by round."""
    gen = torch.Generator().manual_seed(seed)
    source = P if point_mass else Q
    out: list[int] = []
    while len(out) < SEQ_LEN:
        drafts = torch.multinomial(source, NUM_DRAFTS, replacement=True, generator=gen).tolist()
        q_rows = None if point_mass else Q.expand(NUM_DRAFTS, -1)
        verified = verify_sampled(P.expand(NUM_DRAFTS + 1, -1), drafts, q_rows, gen, rule)
        out += verified.token_ids
    return out[:SEQ_LEN]


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = torch.tensor((len(probs) - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2.0, dtype=torch.float64)))


def _p_values(rule: str, point_mass: bool) -> list[float]:
    """Chi-square p-values of each position's marginal and of the first pair's joint."""
    seqs = torch.tensor([_speculative_sequence(s, rule, point_mass) for s in range(NUM_SEEDS)])
    values = [_chi_square_p_value(torch.bincount(seqs[:, i], minlength=8).double(), P)
              for i in range(SEQ_LEN)]
    pairs = torch.bincount(seqs[:, 0] * 8 + seqs[:, 1], minlength=64).double()
    values.append(_chi_square_p_value(pairs, torch.outer(P, P).reshape(-1)))
    return values


@pytest.mark.parametrize("point_mass", [False, True], ids=["model_q", "point_mass_q"])
def test_rejection_sampling_preserves_the_target_distribution(point_mass):
    p_values = _p_values("exact", point_mass)
    assert min(p_values) > CRITICAL, p_values


@pytest.mark.parametrize("point_mass", [False, True], ids=["model_q", "point_mass_q"])
def test_negative_control_the_wrong_rule_is_detected(point_mass):
    p_values = _p_values("wrong", point_mass)
    assert min(p_values) < 1e-6, p_values


def test_identical_draft_and_target_accept_everything():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        drafts = torch.multinomial(P, 4, replacement=True, generator=gen).tolist()
        verified = verify_sampled(P.expand(5, -1), drafts, P.expand(4, -1), gen)
        assert verified.num_accepted == 4 and verified.token_ids[:4] == drafts


def test_a_draft_the_target_rules_out_is_always_rejected_and_never_resampled():
    p = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        verified = verify_sampled(p.expand(2, -1), [2], None, gen)
        assert verified.num_accepted == 0 and verified.token_ids[0] in (0, 1)


def test_target_probs_apply_temperature_and_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = target_probs(logits, SamplingParams(temperature=0.5, top_k=2))
    expected = torch.softmax(torch.tensor([4.0, 2.0]), 0)
    torch.testing.assert_close(probs[0, :2], expected)
    assert probs[0, 2:].sum() == 0
