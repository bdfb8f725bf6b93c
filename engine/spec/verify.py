"""Verification: which draft tokens the target model accepts, and the token after them.

One request's verification rows (its last real token, then its k drafts):

    row:                   0        1      ...   k
    target distribution:   p_1      p_2          p_{k+1}
    draft token checked:   d_1      d_2          (none: the bonus row)

Greedy requests keep the longest prefix with d_j == argmax p_j and then append argmax of
the first mismatching row (the correction), or of row k when all match (the bonus).

Sampled requests use exact rejection sampling (Leviathan et al. 2023, Chen et al. 2023):
accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw the
replacement from normalize(max(0, p_j - q_j)); when every draft survives, draw the bonus
from p_{k+1}. The emitted tokens are then distributed exactly as if sampled from p one by
one. A drafter without a distribution (n-gram) is a point mass: q_j = onehot(d_j).

`rule="wrong"` resamples a rejected position from p_j instead of the residual. It is a
classic bug kept only as the negative control of the distribution test, which must fail.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from duplex.engine.sampler import apply_top_k_top_p_min_p
from duplex.engine.sampling_params import SamplingParams

RULES = ("exact", "wrong")


class Verified(NamedTuple):
    token_ids: list[int]  # the accepted drafts, then one correction or bonus token
    num_accepted: int  # accepted drafts (len(token_ids) - 1)


def verify_greedy(target_ids: Sequence[int], draft_ids: Sequence[int]) -> Verified:
    """target_ids: argmax of each of the k + 1 rows; draft_ids: the k drafts."""
    assert len(target_ids) == len(draft_ids) + 1, "one target row per draft, plus the bonus row"
    num_accepted = 0
    while num_accepted < len(draft_ids) and draft_ids[num_accepted] == target_ids[num_accepted]:
        num_accepted += 1
    return Verified(list(draft_ids[:num_accepted]) + [int(target_ids[num_accepted])],
                    num_accepted)


def verify_sampled(target_probs: torch.Tensor, draft_ids: Sequence[int],
                   draft_probs: torch.Tensor | None, generator: torch.Generator,
                   rule: str = "exact") -> Verified:
    """target_probs: [k + 1, vocab] p rows; draft_probs: [k, vocab] q rows, or None for
    point masses. Draws k uniforms and then one categorical sample from `generator`."""
    assert rule in RULES, f"rule must be one of {RULES}"
    num_drafts = len(draft_ids)
    assert target_probs.shape[0] == num_drafts + 1, "one target row per draft, plus the bonus row"
    device = target_probs.device
    drafts = torch.tensor(list(draft_ids), dtype=torch.long, device=device)
    rows = torch.arange(num_drafts, device=device)
    p_x = target_probs[rows, drafts]  # [k]
    q_x = torch.ones(num_drafts, device=device) if draft_probs is None \
        else draft_probs[rows, drafts]
    # drawn where the generator lives (its stream of numbers is the contract), then moved
    uniforms = torch.rand(num_drafts, generator=generator, dtype=target_probs.dtype,
                          device=generator.device).to(device)
    accepted = uniforms * q_x < p_x  # u < p / q, without dividing by a zero q
    num_accepted = int(torch.cumprod(accepted.to(torch.int64), 0).sum()) if num_drafts else 0
    if num_accepted == num_drafts:
        final = target_probs[num_drafts]
    elif rule == "wrong":
        final = target_probs[num_accepted]
    else:
        final = _residual(target_probs[num_accepted], draft_ids[num_accepted],
                          None if draft_probs is None else draft_probs[num_accepted])
    token = int(torch.multinomial(final.to(generator.device), 1, generator=generator))
    return Verified(list(draft_ids[:num_accepted]) + [token], num_accepted)


def _residual(p: torch.Tensor, draft_id: int, q: torch.Tensor | None) -> torch.Tensor:
    """normalize(max(0, p - q)); q None is the point mass on draft_id."""
    if q is None:
        residual = p.clone()
        residual[draft_id] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    # A zero residual means p <= q everywhere, so p == q and the rejection had probability 0;
    # only rounding gets here, and p itself is then the right distribution.
    return residual / total if total > 0 else p


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of fp32 logits [n, vocab] -> the distributions a sampled request draws from
    (temperature, then top-k / top-p / min-p), as the Sampler does for one token."""
    logits = logits / params.temperature
    if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0:
        logits = apply_top_k_top_p_min_p(logits, params.top_k, params.top_p, params.min_p)
    return torch.softmax(logits, dim=-1)
