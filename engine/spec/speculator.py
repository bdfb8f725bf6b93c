"""Speculator: the engine's speculative decoding, one object between scheduler and sampler.

Per step (EngineCore.step calls these in order):

    1 propose(running)      drafts -> req.spec_token_ids of decoding requests, lengths
                            chosen by the load-aware stopping rule (confidence.py)
    2 clip(scheduled)       drop the drafts the step's token budget did not reach
    3 logit_rows(...)       which rows of the flattened batch need logits: every draft
                            row and the bonus row of a drafting request, one row otherwise
    4 verify(req, logits)   accepted drafts + one token (verify.py), stats, head update
    5 free(req)             on finish / abort

It owns the drafts' side information (q rows, confidence features), the per-request
acceptance EMA, the acceptance statistics and the confidence head. The request's own
progress (tokens, num_computed_tokens, blocks) stays with the Request, the engine and the
KV manager: after verification EngineCore rolls num_computed_tokens back to the tokens
kept and asks KVCacheManager.trim to free blocks that only held rejected drafts.

Drafting that the rule switched off is retried now and then (EXPLORE_BUDGET): one request
drafts its full length, so the acceptance estimates can recover when the workload changes.

Requests with penalties or a logit bias, or below min_tokens, do not draft (their next-token rule depends
on the tokens before it in ways verification of a whole run does not reproduce). Sampled
requests keep their distribution exactly; a seeded one repeats its tokens only when its
draft lengths repeat too (they depend on the batch and on the measured cost curve; a
configured spec_token_cost makes the latter fixed).
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Sequence

import msgspec
import numpy as np
import torch

from duplex.engine.config import SpecConfig
from duplex.engine.cost_model import CostModel
from duplex.engine.kv_manager import KVTables
from duplex.engine.request import Request
from duplex.engine.scheduler import ScheduledRequest
from duplex.engine.spec.confidence import (ConfidenceHead, best_uniform_length, choose_lengths,
                                    keep_drafting_threshold, make_features)
from duplex.engine.spec.draft_model import (DraftModelDrafter, ModelDrafterBase, RequestView,
                                     SelfDrafter, relative_cost)
from duplex.engine.spec.ngram import NgramDrafter
from duplex.engine.spec.verify import Verified, target_probs, verify_greedy, verify_sampled
from duplex.engine.stats import CalibrationBin, HeadStats, SpecStats

MAX_POSITIONS = 16  # EngineConfig caps num_draft_tokens here
_EMA = 0.8  # weight of the past in a request's acceptance EMA
# When the rule has switched drafting off, one request now and then drafts its full length
# anyway (the estimates only change with fresh verifications), spaced so that these rounds
# cost about EXPLORE_BUDGET of the steps they are spread over.
EXPLORE_BUDGET = 0.02
PRIOR_ACCEPTANCE = 0.75
_PRIOR = (3.0, 1.0)  # pseudo-counts (accepted, rejected) of the acceptance estimates
_FORGET = 0.98  # per verification round, for the estimates that steer drafting


class _Pending(NamedTuple):
    """A request's drafts in flight between propose and verify."""
    probs: torch.Tensor | None  # q rows [k, vocab], None: point masses or greedy
    features: np.ndarray  # [k, NUM_FEATURES]


class AcceptanceStats:
    """Counts per draft position: proposed, reached by verification, accepted; lifetime
    totals for the metrics, and exponentially forgotten ones (about the last 1 / (1 -
    _FORGET) rounds) for the estimates that steer drafting, which must follow the workload."""

    def __init__(self) -> None:
        self.proposed = np.zeros(MAX_POSITIONS)
        self.reached = np.zeros(MAX_POSITIONS)
        self.accepted = np.zeros(MAX_POSITIONS)
        self.recent_reached = np.zeros(MAX_POSITIONS)
        self.recent_accepted = np.zeros(MAX_POSITIONS)
        self.num_rounds = 0  # verifications with at least one draft
        self.num_emitted = 0  # tokens those verifications appended

    def record(self, num_proposed: int, num_accepted: int, num_emitted: int) -> None:
        num_reached = min(num_accepted + 1, num_proposed)
        self.proposed[:num_proposed] += 1
        self.reached[:num_reached] += 1
        self.accepted[:num_accepted] += 1
        self.recent_reached *= _FORGET
        self.recent_accepted *= _FORGET
        self.recent_reached[:num_reached] += 1
        self.recent_accepted[:num_accepted] += 1
        self.num_rounds += 1
        self.num_emitted += num_emitted

    def survival(self, length: int) -> np.ndarray:
        """Estimated P(the first j+1 drafts are accepted), j < length, from the recent
        conditional rates under an optimistic prior (PRIOR_ACCEPTANCE before any data, so
        a fresh engine tries drafting and learns)."""
        rates = (self.recent_accepted[:length] + _PRIOR[0]) / \
            (self.recent_reached[:length] + sum(_PRIOR))
        return np.cumprod(rates)

    @property
    def conditional_rate(self) -> float:
        return float((self.recent_accepted.sum() + _PRIOR[0]) /
                     (self.recent_reached.sum() + sum(_PRIOR)))

    def stats(self) -> SpecStats:
        return SpecStats(num_draft_proposed=float(self.proposed.sum()),
                         num_draft_accepted=float(self.accepted.sum()),
                         num_rounds=float(self.num_rounds), num_emitted=float(self.num_emitted),
                         proposed_by_position=[float(n) for n in self.proposed],
                         accepted_by_position=[float(n) for n in self.accepted])


class Speculator:
    def __init__(self, config: SpecConfig, drafter, max_model_len: int,
                 cost_model: CostModel) -> None:
        """`cost_model`: the engine's, its forward-cost curve seeded (`build` does that)."""
        self.config = config
        self.drafter = drafter  # NgramDrafter or a ModelDrafterBase
        self.cost_model = cost_model
        step_cost = self.step_cost = cost_model.relative_cost
        self.max_model_len = max_model_len
        self.head = ConfidenceHead(prior_acceptance=PRIOR_ACCEPTANCE)
        self.stats = AcceptanceStats()
        self.recent: dict[str, float] = {}  # req_id -> acceptance EMA
        self.pending: dict[str, _Pending] = {}
        self.num_idle_steps = 0  # decoding steps in a row without drafts
        k = config.num_draft_tokens
        explore_cost = step_cost(1 + k) - 1.0 + k * drafter.cost
        self.explore_every = max(16, int(explore_cost / EXPLORE_BUDGET))

    @classmethod
    def build(cls, config: SpecConfig, *, model, runner, kv, load_model: Callable,
              cost_model: CostModel, num_kv_blocks: int, block_size: int, dtype: torch.dtype,
              max_model_len: int, seed: int = 0) -> Speculator:
        """The drafter config.speculation names, wired to the engine's model, runner, KV and
        cost model, whose forward-cost curve is measured now unless config.spec_token_cost
        gives a line."""
        if config.spec_token_cost > 0:
            cost_model.seed_token_cost(config.spec_token_cost)
        else:
            cost_model.seed_forward_costs(*measure_forward_costs(runner, num_kv_blocks))
        if config.speculation == "ngram":
            drafter = NgramDrafter(max_n=8)
        elif config.speculation == "self":
            num_layers = config.spec_draft_layers or max(1, len(model.layers) // 4)
            drafter = SelfDrafter(model, runner, kv, num_layers, seed)
        elif config.speculation == "draft":
            if not config.draft_model:
                raise ValueError("speculation 'draft' needs draft_model (a local model path)")
            draft = load_model(config.draft_model)
            if draft.args.vocab_size != model.args.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft.args.vocab_size}) "
                                 f"differs from the target's ({model.args.vocab_size})")
            drafter = DraftModelDrafter(draft, num_kv_blocks, block_size, dtype,
                                        relative_cost(draft.args, model.args), seed)
        else:
            raise ValueError(f"unknown speculation method {config.speculation!r}")
        return cls(config, drafter, max_model_len, cost_model)

    # ------------------------------------------------------------------ 1 propose
    def propose(self, running: Sequence[Request]) -> None:
        self.pending.clear()
        for req in running:  # drafts a budget-starved step never verified are stale
            req.set_drafts([])
        decoding = [r for r in running if r.is_decoding]
        limits = [self._max_drafts(r) for r in decoding]
        if not any(limits):
            return
        explore = None
        if self.num_idle_steps >= self.explore_every:
            explore = next((i for i, n in enumerate(limits) if n), None)
        if isinstance(self.drafter, NgramDrafter):
            self._propose_ngram(decoding, limits, explore)
        else:
            self._propose_model(decoding, limits, explore)
        if any(r.spec_token_ids for r in decoding):
            self.num_idle_steps = 0
        elif decoding:
            self.num_idle_steps += 1

    def _max_drafts(self, req: Request) -> int:
        params = req.params
        if not params.speculate or params.has_penalties or params.logit_bias or \
                req.num_output_tokens < params.min_tokens:
            return 0
        # every draft kept still leaves room for the bonus token
        return max(0, min(self.config.num_draft_tokens,
                          req.max_tokens - req.num_output_tokens - 1,
                          self.max_model_len - req.num_tokens - 1))

    def _propose_ngram(self, reqs: list[Request], limits: list[int],
                       explore: int | None) -> None:
        drafts, features = [], []
        for req, limit in zip(reqs, limits):
            match = self.drafter.propose(req.all_token_ids, limit)
            num = len(match.token_ids)
            drafts.append(match.token_ids)
            features.append(make_features(match.agreement, 0.0, np.arange(num), match.match_len,
                                          self._recent(req)))
        lengths = self._lengths(drafts, features, draft_cost=0.0)
        if explore is not None:
            lengths[explore] = len(drafts[explore])
        for req, tokens, feats, n in zip(reqs, drafts, features, lengths):
            self._set(req, tokens[:n], None, feats[:n])

    def _propose_model(self, reqs: list[Request], limits: list[int],
                       explore: int | None) -> None:
        drafter: ModelDrafterBase = self.drafter
        # Every draft forward is paid before its tokens can be judged, so the recent
        # acceptance curve first bounds the run (to nothing when drafting does not pay).
        k = best_uniform_length(self.stats.survival(max(limits, default=0)),
                                sum(1 for n in limits if n), sum(1 for n in limits if not n),
                                self.step_cost, drafter.cost)
        limits = [n if i == explore else min(n, k) for i, n in enumerate(limits)]
        if not any(limits):
            return
        keep_going = None
        if self.config.spec_confidence:
            keep_going = self._keep_going_rule(reqs, explore)
        drafts = drafter.propose(reqs, limits, keep_going)
        features = [make_features(d.draft_prob, d.entropy, np.arange(len(d.token_ids)), 0,
                                  self._recent(req)) for req, d in zip(reqs, drafts)]
        lengths = [len(d.token_ids) for d in drafts]
        if self.config.spec_confidence:
            lengths = self._lengths([d.token_ids for d in drafts], features, drafter.cost)
            if explore is not None:
                lengths[explore] = len(drafts[explore].token_ids)
        for req, d, feats, n in zip(reqs, drafts, features, lengths):
            self._set(req, d.token_ids[:n], None if d.probs is None else d.probs[:n], feats[:n])

    def _keep_going_rule(self, reqs: list[Request], explore: int | None):
        """The head's stopping rule while drafting: stop a request once the survival of
        its run falls below what one more draft token must earn."""
        num_reqs, k = len(reqs), self.config.num_draft_tokens
        cost = self.step_cost
        c = (cost(num_reqs * (1 + k)) - cost(num_reqs)) / (num_reqs * k)  # mean per token
        share = self.drafter.cost * cost(num_reqs) / num_reqs  # of one more draft forward
        survival = [1.0] * num_reqs
        totals = dict(value=float(num_reqs), cost=cost(num_reqs))

        def keep_going(i: int, j: int, draft_prob: float, entropy: float) -> bool:
            x = make_features(draft_prob, entropy, j, 0, self._recent(reqs[i]))
            survival[i] *= float(self.head.predict(x)[0])
            totals["value"] += survival[i]
            totals["cost"] += c + share
            threshold = keep_drafting_threshold(totals["value"], totals["cost"], c, share)
            return i == explore or survival[i] >= threshold
        return keep_going

    def _lengths(self, drafts: list[list[int]], features: list[np.ndarray],
                 draft_cost: float) -> list[int]:
        if self.config.spec_confidence:
            survival = [np.cumprod(self.head.predict(f)) if len(f) else np.zeros(0)
                        for f in features]
            return choose_lengths(survival, self.step_cost)
        num_drafting = sum(1 for d in drafts if d)
        k = best_uniform_length(self.stats.survival(max(map(len, drafts), default=0)),
                                num_drafting, len(drafts) - num_drafting, self.step_cost,
                                draft_cost)
        return [min(len(d), k) for d in drafts]

    def _set(self, req: Request, token_ids: list[int], probs, features: np.ndarray) -> None:
        req.set_drafts(token_ids)
        if token_ids:
            self.pending[req.req_id] = _Pending(probs, features)

    def _recent(self, req: Request) -> float:
        return self.recent.get(req.req_id, self.stats.conditional_rate)

    # ------------------------------------------------------------------ 2, 3 the batch
    def clip(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Keep only the drafts the scheduler's token budget reached."""
        for req, num_new in scheduled:
            if req.spec_token_ids:
                num_reached = max(0, req.num_computed_tokens + num_new - req.num_tokens)
                req.keep_drafts(num_reached)

    @staticmethod
    def logit_rows(sample_positions: Sequence[int], reqs: Sequence[Request]) -> list[int]:
        """Rows of the flattened batch to compute logits for: for each sampled request its
        draft rows and the last row (the bonus), in order; one row if it has no drafts."""
        rows = []
        for last, req in zip(sample_positions, reqs):
            rows.extend(range(last - len(req.spec_token_ids), last + 1))
        return rows

    # ------------------------------------------------------------------ 4 verify
    def verify(self, req: Request, logits: torch.Tensor,
               default_generator: torch.Generator) -> Verified:
        """logits: fp32 [k + 1, vocab] raw rows of req's last token and its k drafts."""
        drafts = req.spec_token_ids
        pending = self.pending.pop(req.req_id)
        if req.params.is_greedy:
            verified = verify_greedy(torch.argmax(logits, dim=-1).tolist(), drafts)
        else:
            probs = target_probs(logits, req.params)
            verified = verify_sampled(probs, drafts, pending.probs,
                                      req.generator or default_generator)
        self._learn(req, pending.features, len(drafts), verified.num_accepted)
        return verified

    def _learn(self, req: Request, features: np.ndarray, num_proposed: int,
               num_accepted: int) -> None:
        num_reached = min(num_accepted + 1, num_proposed)
        outcomes = np.arange(num_reached) < num_accepted
        self.head.update(features[:num_reached], outcomes)
        self.stats.record(num_proposed, num_accepted, num_accepted + 1)
        recent = self._recent(req)
        for outcome in outcomes:
            recent = _EMA * recent + (1 - _EMA) * float(outcome)
        self.recent[req.req_id] = recent

    # ------------------------------------------------------------------ 5 and stats
    def free(self, req: Request) -> None:
        self.recent.pop(req.req_id, None)
        self.pending.pop(req.req_id, None)
        if isinstance(self.drafter, ModelDrafterBase):
            self.drafter.free(req)

    def report(self) -> SpecStats:
        """For WorkerStats: acceptance, the head's calibration, the measured step cost."""
        report = self.head.calibration.report()
        bins = [CalibrationBin(low=b["low"], count=float(b["count"]),
                               mean_predicted=b["mean_predicted"], observed=b["observed"])
                for b in report["bins"]]
        head = HeadStats(num=float(report["num"]), log_loss=report["log_loss"],
                         brier=report["brier"], ece=report["ece"], bins=bins)
        step_cost_tokens, step_cost = self.cost_model.forward_costs()
        return msgspec.structs.replace(self.stats.stats(), head=head,
                                       step_cost_tokens=step_cost_tokens, step_cost=step_cost)


GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # forward sizes measured at start-up


@torch.inference_mode()
def measure_forward_costs(runner, num_free_blocks: int, repeats: int = 3,
                          context: int = 64) -> tuple[list[int], list[float]]:
    """(rows, seconds): the model timed on one sequence of `context` cached tokens plus n
    new ones, for n on GRID (as far as num_free_blocks allow), logits for every new row as
    verification needs; the minimum of `repeats` runs, as interference on a shared machine
    only adds. Writes KV into blocks no request owns yet (called before the first request)."""
    grid = [n for n in GRID if -(-(context + n) // runner.block_size) <= num_free_blocks]
    times = {}
    for n in grid:
        tokens = [1] * (context + n)
        view = RequestView("forward-cost", tokens, context)
        tables = KVTables({view.req_id: list(range(-(-len(tokens) // runner.block_size)))})
        inputs = runner.prepare([ScheduledRequest(view, n)], tables)
        rows = list(range(n))
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.execute(inputs, rows)
            runs.append(time.perf_counter() - start)
        times[n] = min(runs)
    return list(times), [times[n] for n in times]
