"""Property-based state machine over Scheduler + KVCacheManager + BlockPool with a fake model
whose next token is a pure function of the sequence so far (so recompute after preemption
must reproduce the same tokens). Invariants after every step: free + used = total, no block
is owned twice, ref counts equal owners, and every request ends with the tokens it would
have produced alone."""
from __future__ import annotations

import hashlib

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from duplex.engine.block_pool import BlockPool
from duplex.engine.kv_manager import KVCacheManager
from duplex.engine.request import Request
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.scheduler import Scheduler
from duplex.engine.step_policy import shortest_first
from duplex.kvstore import keys as kvkeys

BS = 4
VOCAB = 50


def next_token(tokens: list[int]) -> int:
    return hashlib.blake2b(bytes(str(tokens), "ascii"), digest_size=2).digest()[0] % VOCAB


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
    return out


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12)
        ns = kvkeys.namespace("fake", "f32", BS)
        self.kv = KVCacheManager(self.pool, BS, lambda salt: ns)
        self.sched = Scheduler(self.kv, max_num_seqs=4, max_num_batched_tokens=10,
                               max_model_len=40)
        self.reqs: dict[str, Request] = {}
        self.done: dict[str, list[int]] = {}
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=14),
          max_tokens=st.integers(1, 8))
    def add(self, prompt, max_tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), (),
                      max_tokens=max_tokens)
        self.reqs[rid] = req
        self.sched.add(req)

    @rule()
    def step(self):
        out = self.sched.schedule()
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        for req, num_new in out.scheduled:
            assert req.num_computed_tokens + num_new <= req.num_tokens
            assert len(self.kv.block_ids(req.req_id)) * BS >= req.num_computed_tokens + num_new
            req.num_computed_tokens += num_new
            self.kv.publish(req)
            if req.num_computed_tokens == req.num_tokens:
                req.add_token(next_token(req.all_token_ids))
                if req.check_stop(40):
                    self.sched.remove(req)
                    self.done[req.req_id] = req.output_token_ids
                    del self.reqs[req.req_id]

    @rule(data=st.data())
    def abort(self, data):
        if self.reqs:
            rid = data.draw(st.sampled_from(sorted(self.reqs)))
            self.sched.remove(self.reqs.pop(rid))

    @invariant()
    def blocks_accounted(self):
        owners: dict[int, int] = {}
        for req in self.sched.running + list(self.sched.waiting):
            block_ids = self.kv.block_ids(req.req_id)
            assert len(set(block_ids)) == len(block_ids), "a block listed twice"
            for b in block_ids:
                owners[b] = owners.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_cnt[b] == owners.get(b, 0), f"block {b} ref count"
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_blocks
        assert self.pool.num_used_blocks == len(owners)

    @invariant()
    def outputs_are_exact(self):
        for rid, out in self.done.items():
            req_prompt = self._prompts[rid] if hasattr(self, "_prompts") else None
            assert req_prompt is None or out == expected_output(req_prompt, len(out))

    def teardown(self):
        # drain: everything still queued must finish with the exact tokens
        for _ in range(500):
            if not self.sched.has_unfinished:
                break
            self.step()
        assert not self.sched.has_unfinished, "requests left unfinished (a hang)"
        assert self.pool.num_used_blocks == 0


class CheckedMachine(SchedulerMachine):
    """Also remembers prompts so finished outputs are compared with a solo run."""

    def __init__(self):
        super().__init__()
        self._prompts = {}

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=14),
          max_tokens=st.integers(1, 8))
    def add(self, prompt, max_tokens):
        self._prompts[f"r{self.next_id}"] = list(prompt)
        super().add(prompt, max_tokens)


CheckedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                            deadline=None)
TestScheduler = CheckedMachine.TestCase


class ShortestFirstMachine(CheckedMachine):
    """The same invariants with served workers' order: prompts shortest remaining first,
    passed over (not preempting) when blocks run short, arrival order only when nothing
    else fits."""

    def __init__(self):
        super().__init__()
        self.sched = Scheduler(self.kv, max_num_seqs=4, max_num_batched_tokens=10,
                               max_model_len=40, prefill_order=shortest_first())


ShortestFirstMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                                  deadline=None)
TestShortestFirstScheduler = ShortestFirstMachine.TestCase
