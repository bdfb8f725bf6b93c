"""The model runner's block-table rows kept between steps (engine/model_runner.py
BlockTables), driven through the KV manager as the engine drives it: every step's table
equals the one built from scratch from each request's block ids, through growth, speculative
trims, preemption and a new request under a finished one's id."""
from __future__ import annotations

import numpy as np

from duplex.engine.block_pool import BlockPool
from duplex.engine.kv_manager import KVCacheManager
from duplex.engine.model_runner import BlockTables
from duplex.engine.request import Request
from duplex.engine.sampling_params import SamplingParams
from duplex.kvstore import keys as kvkeys

BS = 4


def fresh(block_tables, num_cols: int) -> np.ndarray:
    table = np.zeros((len(block_tables), num_cols), dtype=np.int32)
    for i, block_ids in enumerate(block_tables):
        table[i, :len(block_ids)] = block_ids
    return table


def check(tables: BlockTables, kv: KVCacheManager, reqs) -> None:
    """The kept rows of reqs equal their tables in kv, built from scratch."""
    check_tables(tables, [r.req_id for r in reqs], [kv.block_ids(r.req_id) for r in reqs])


def check_tables(tables: BlockTables, req_ids, block_tables) -> None:
    num_cols = max(1, max(len(t) for t in block_tables))
    assert np.array_equal(tables.table(req_ids, block_tables, num_cols),
                          fresh(block_tables, num_cols))


def test_rows_kept_between_steps_match_the_block_ids():
    ns = kvkeys.namespace("m", "f", BS)
    kv = KVCacheManager(BlockPool(64), BS, lambda salt: ns)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=40), ())
    b = Request("b", list(range(3)), SamplingParams(max_tokens=40), ())
    tables = BlockTables()
    for req in (a, b):
        assert kv.allocate_slots(req, req.num_prompt_tokens)
        req.num_computed_tokens = req.num_prompt_tokens
    check(tables, kv, [a, b])
    for step in range(30):  # decode: a block every BS tokens, across the rows' spare room
        for req in (a, b):
            assert kv.allocate_slots(req, 1)
            req.output_token_ids.append(7)
            req.num_computed_tokens += 1
        check(tables, kv, [b, a] if step % 2 else [a, b])  # the batch order changes too
    # a speculative step reserves blocks for drafts, then verification cuts them again
    assert kv.allocate_slots(a, 9)
    check(tables, kv, [a, b])
    reserved = list(kv.block_ids("a"))
    kv.trim(a)
    c = Request("c", list(range(8)), SamplingParams(max_tokens=4), ())
    assert kv.allocate_slots(c, 8)  # takes the blocks the trim gave back
    assert kv.allocate_slots(a, 9)  # as many blocks as before the trim, other ones
    assert len(kv.block_ids("a")) == len(reserved) and kv.block_ids("a") != reserved
    check(tables, kv, [a, b, c])
    # preemption frees every block; readmission takes new ones
    kv.free(b)
    b.num_computed_tokens = 0
    assert kv.allocate_slots(b, b.num_tokens)
    check(tables, kv, [a, b])
    # a finished request's id reused by a new request with blocks of the same count
    kv.free(a)
    again = Request("a", list(range(40, 50)), SamplingParams(max_tokens=4), ())
    assert kv.allocate_slots(again, again.num_prompt_tokens)
    check(tables, kv, [again, b])


def test_rows_of_requests_no_longer_running_are_dropped():
    tables = BlockTables()
    for i in range(200):
        check_tables(tables, [f"r{i}"], [[i]])
    assert len(tables.rows) <= BlockTables.KEEP_ROWS * 16 + 1
