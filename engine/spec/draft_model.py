"""Model drafters: a small model proposes k tokens, one batched forward per draft token.

Two sources of the draft model:

* `DraftModelDrafter`: another `engine.models` model sharing the target's tokenizer, with
  its own paged KV (a second ModelRunner and BlockPool). Its cache trails the request:
  each round first catches it up on the tokens it has not seen (the prompt, the tokens
  verification appended), after rolling back the draft tokens verification rejected.
* `SelfDrafter` (early exit): the target's first N layers, its final norm and its head.
  Those layers *are* the target's, so the draft reads the target's KV cache for them and
  writes its own layer < N KV into the very slots verification will then fill with the
  same values (same tokens at the same positions). It needs no cache of its own, only
  the target slots reserved before it runs.

Slots a self-draft round writes (n = req.num_tokens, k drafts):

    position:   n-1        n     ...  n+k-2      n+k-1
    fed token:  t_{n-1}    d_1        d_{k-1}    (d_k is never fed)
    proposes:   d_1        d_2        d_k

Greedy requests draft by argmax. Sampled requests draw from the drafter's distribution q
after the request's own temperature / top-k / top-p / min-p, and keep q for rejection
sampling. Every draft token carries q(d) and the entropy of q for the confidence head.
"""
from __future__ import annotations

import copy
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from duplex.engine.block_pool import BlockPool
from duplex.engine.kv_manager import KVCacheManager, KVTables
from duplex.engine.model_runner import ModelRunner
from duplex.engine.request import Request
from duplex.engine.scheduler import ScheduledRequest
from duplex.engine.spec.verify import target_probs

# keep_going(index of the request in the round, position j, q(d_j), entropy) -> bool
KeepGoing = Callable[[int, int, float, float], bool]


class ModelDraft(NamedTuple):
    token_ids: list[int]
    probs: torch.Tensor | None  # q rows [k, vocab] for a sampled request; None when greedy
    draft_prob: np.ndarray  # q(d_j) per token [k]
    entropy: np.ndarray  # entropy of q_j in nats [k]


class RequestView:
    """The fields of a Request that ModelRunner.prepare reads, for a draft forward (its
    block tables are looked up by req_id, as a request's are)."""
    __slots__ = ("req_id", "all_token_ids", "spec_token_ids", "num_computed_tokens",
                 "num_tokens", "replay_end", "num_prompt_tokens")

    def __init__(self, req_id: str, token_ids: list[int], num_computed: int) -> None:
        self.req_id = req_id
        self.all_token_ids = token_ids
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = num_computed
        self.num_tokens = len(token_ids)
        self.replay_end = 0
        self.num_prompt_tokens = 0  # a draft forward is never a prompt step (quant.prompt_step)

    def token_slice(self, start: int, end: int) -> list[int]:
        return (self.all_token_ids + self.spec_token_ids)[start:end]


class _Round:
    """One request's drafts in one round."""

    def __init__(self, req: Request, max_len: int) -> None:
        self.req = req
        self.max_len = max_len
        self.token_ids: list[int] = []
        self.q_rows: list[torch.Tensor] = []
        self.draft_prob: list[float] = []
        self.entropy: list[float] = []
        self.active = max_len > 0

    def result(self) -> ModelDraft:
        probs = torch.stack(self.q_rows) if self.q_rows else None
        return ModelDraft(self.token_ids, probs, np.asarray(self.draft_prob),
                          np.asarray(self.entropy))


class ModelDrafterBase:
    """Draft rounds shared by both drafters; subclasses say where the KV lives."""
    cost: float  # one draft forward's cost relative to the target step's fixed part

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, reqs: Sequence[Request], max_lens: Sequence[int],
                keep_going: KeepGoing | None = None) -> list[ModelDraft]:
        """Up to max_lens[i] drafts for each decoding request reqs[i]; a request stops
        early when keep_going says so (the confidence head's stopping rule)."""
        rounds = [_Round(req, n) for req, n in zip(reqs, max_lens)]
        for r in rounds:
            r.active = r.active and self._reserve(r.req, r.max_len)
        for j in range(max(max_lens, default=0)):
            active = [i for i, r in enumerate(rounds) if r.active]
            if not active:
                break
            logits = self._forward([self._view(rounds[i], j) for i in active])  # [n, vocab]
            for row, i in enumerate(active):
                r = rounds[i]
                self._draw(r, logits[row])
                r.active = len(r.token_ids) < r.max_len and (
                    keep_going is None or keep_going(i, j, r.draft_prob[-1], r.entropy[-1]))
        return [r.result() for r in rounds]

    def _draw(self, r: _Round, logits: torch.Tensor) -> None:
        params = r.req.params
        if params.is_greedy:
            probs = torch.softmax(logits, dim=-1)
            token = int(torch.argmax(logits))
        else:
            probs = target_probs(logits[None], params)[0]
            token = int(torch.multinomial(probs, 1, generator=r.req.draft_generator or self.generator))
            r.q_rows.append(probs)
        logp = torch.log(probs.clamp_min(1e-30))
        r.entropy.append(float(-(probs * logp).sum()))
        r.draft_prob.append(float(probs[token]))
        r.token_ids.append(token)

    # subclass hooks
    def _reserve(self, req: Request, max_len: int) -> bool:
        raise NotImplementedError

    def _view(self, r: _Round, j: int) -> RequestView:
        raise NotImplementedError

    def _forward(self, views: list[RequestView]) -> torch.Tensor:
        raise NotImplementedError

    def free(self, req: Request) -> None:
        """Forget req (finished or aborted)."""


def relative_cost(draft_args, target_args, num_draft_layers: int | None = None) -> float:
    """A draft forward's cost as a share of the target's, by matmul weights read per token
    (its layers and its head); num_draft_layers: an early exit of the target."""
    def weights(a, num_layers):
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        layer = a.hidden_size * (q + 2 * kv) + q * a.hidden_size \
            + 3 * a.hidden_size * a.intermediate_size
        return num_layers * layer + a.vocab_size * a.hidden_size
    draft_layers = draft_args.num_layers if num_draft_layers is None else num_draft_layers
    return weights(draft_args, draft_layers) / weights(target_args, target_args.num_layers)


def early_exit_model(model, num_layers: int):
    """A view of model that runs only its first num_layers layers, then the final norm and
    head. It shares every weight tensor; nothing is copied."""
    assert 1 <= num_layers < len(model.layers), "an early exit keeps some, not all, layers"
    early = copy.copy(model)
    early.layers = model.layers[:num_layers]
    if hasattr(model, "layer_windows"):
        early.layer_windows = model.layer_windows[:num_layers]
    return early


class SelfDrafter(ModelDrafterBase):
    """The target's first num_layers layers (early exit), on the target's own KV cache."""

    def __init__(self, model, runner: ModelRunner, kv: KVCacheManager, num_layers: int,
                 seed: int = 0) -> None:
        super().__init__(seed)
        self.model = early_exit_model(model, num_layers)
        self.runner = runner
        self.kv = kv  # the target's: slots reserved for the drafts, read through its tables
        self.cost = relative_cost(model.args, model.args, num_layers)

    def _reserve(self, req: Request, max_len: int) -> bool:
        # drafting writes positions num_computed .. num_computed + max_len - 1
        return self.kv.allocate_slots(req, max_len)

    def _view(self, r: _Round, j: int) -> RequestView:
        tokens = r.req.all_token_ids + r.token_ids
        return RequestView(r.req.req_id, tokens, len(tokens) - 1)

    @torch.inference_mode()
    def _forward(self, views: list[RequestView]) -> torch.Tensor:
        inputs = self.runner.prepare([ScheduledRequest(v, v.num_tokens - v.num_computed_tokens)
                                      for v in views], self.kv.tables)
        hidden = self.model.forward(inputs.input_ids, inputs.ctx)  # [T, hidden]
        return self.model.compute_logits(hidden[torch.tensor(inputs.sample_positions)])


class _DraftKV:
    """A request's KV in the draft model's cache: how many of its tokens its blocks hold
    (the last round's fed drafts are checked against what verification kept)."""

    def __init__(self) -> None:
        self.num_computed = 0
        self.tail_start = 0  # position of the first draft token fed last round
        self.tail: list[int] = []  # draft tokens fed last round


class DraftModelDrafter(ModelDrafterBase):
    """A separate draft model with its own paged KV cache."""

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 target_cost: float, seed: int = 0) -> None:
        super().__init__(seed)
        self.runner = ModelRunner(model, num_blocks, block_size, dtype)
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.cost = target_cost
        self.states: dict[str, _DraftKV] = {}
        self.req_to_blocks: dict[str, list[int]] = {}  # block tables in the draft's own pool
        self.tables = KVTables(self.req_to_blocks)

    def _reserve(self, req: Request, max_len: int) -> bool:
        state = self.states.setdefault(req.req_id, _DraftKV())
        tokens = req.all_token_ids
        valid = state.tail_start
        for token in state.tail:  # fed drafts that verification kept are still valid KV
            if valid >= len(tokens) or tokens[valid] != token:
                break
            valid += 1
        state.num_computed = min(state.num_computed, valid, len(tokens) - 1)
        state.tail_start, state.tail = len(tokens), []
        # positions up to len(tokens) + max_len - 2 are written (d_k is never fed)
        table = self.req_to_blocks.setdefault(req.req_id, [])
        need = -(-(len(tokens) + max_len - 1) // self.block_size) - len(table)
        if need > self.pool.num_free_blocks:
            return False
        table += self.pool.allocate(max(0, need))  # grows in place (engine.kv_manager)
        return True

    def _view(self, r: _Round, j: int) -> RequestView:
        state = self.states[r.req.req_id]
        tokens = r.req.all_token_ids + r.token_ids
        view = RequestView(r.req.req_id, tokens, state.num_computed)
        state.num_computed = len(tokens)  # after this forward the cache holds all of them
        state.tail = list(r.token_ids)
        return view

    @torch.inference_mode()
    def _forward(self, views: list[RequestView]) -> torch.Tensor:
        inputs = self.runner.prepare([ScheduledRequest(v, v.num_tokens - v.num_computed_tokens)
                                      for v in views], self.tables)
        return self.runner.execute(inputs)

    def free(self, req: Request) -> None:
        self.states.pop(req.req_id, None)
        self.pool.free(reversed(self.req_to_blocks.pop(req.req_id, [])))
