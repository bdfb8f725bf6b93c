"""Expert parallelism on CPU (gloo, 2 and 4 ranks as separate processes): the engine's output
equals the single-process output, and rebalancing during decoding changes no token."""
from __future__ import annotations

import json
import os

import pytest
import torch

from duplex.engine.expert_parallel import enable_expert_parallel, launch
from duplex.engine.sampling_params import SamplingParams
from duplex.kernels.batch_invariant import set_batch_invariant_mode
from tests.engine.conftest import make_core, run_engine
from tests.moe.conftest import VOCAB

NUM_NEW = 12
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
ARRIVALS = [0, 0, 1, 3]
NO_REBALANCE = 10**9


def _prompts() -> list[list[int]]:
    """Two random prompts and two of few distinct tokens (skewed routing)."""
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 21)] + \
        [[7, 7, 8] * 6, [7] * 5]


def _generate(path: str, run: dict) -> dict:
    """Run the prompts in this process: with EP when `run` has a redundancy setting."""
    with set_batch_invariant_mode(run["batch_invariant"]):
        core = make_core(path, num_threads=1, max_num_batched_tokens=16, block_size=8,
                         batch_invariant=run["batch_invariant"])
        ep = None
        if "redundant" in run:
            ep = enable_expert_parallel(core.model, num_redundant=run["redundant"],
                                        interval_steps=run["interval"])
        outputs = run_engine(core, _prompts(), PARAMS, ARRIVALS)
    report = core.model.expert_load()
    return dict(outputs=outputs, num_rebalances=ep.num_rebalances if ep else 0,
                num_received=ep.num_experts_received if ep else 0,
                num_routed=int(report.expert_load.sum()), imbalance=report.imbalance.tolist())


def _rank_main(rank: int, num_ranks: int, path: str, out_dir: str, runs: list[dict]) -> None:
    results = [_generate(path, run) for run in runs]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


def _run_ep(tmp_path, path: str, num_ranks: int, runs: list[dict]) -> list[list[dict]]:
    """[rank][run] results of `runs`, each on `num_ranks` EP ranks."""
    launch(_rank_main, num_ranks, path, str(tmp_path), runs)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text())
            for rank in range(num_ranks)]


def _assert_same_tokens(got: dict, want: dict, atol: float) -> None:
    for req_id, (tokens, logprobs) in want["outputs"].items():
        got_tokens, got_logprobs = got["outputs"][req_id]
        assert got_tokens == tokens, f"{req_id}: tokens differ"
        if atol == 0:
            assert got_logprobs == logprobs, f"{req_id}: logprobs not bitwise equal"
        else:
            torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs),
                                       atol=atol, rtol=0)


@pytest.fixture(scope="module")
def two_rank_runs(tiny_moe, tmp_path_factory):
    """Qwen3-MoE on 2 ranks: without rebalancing, then rebalancing every 3 steps (2 spare
    slots); plus the single-process reference."""
    path = tiny_moe("qwen3_moe")
    runs = [dict(batch_invariant=False, redundant=0, interval=NO_REBALANCE),
            dict(batch_invariant=False, redundant=2, interval=3)]
    single = _generate(path, dict(batch_invariant=False))
    return single, _run_ep(tmp_path_factory.mktemp("ep2"), path, 2, runs)


def test_two_ranks_match_single_process(two_rank_runs):
    single, ranks = two_rank_runs
    for rank in ranks:
        static = rank[0]
        assert static["num_rebalances"] == 0
        _assert_same_tokens(static, single, atol=1e-5)
        assert static["num_routed"] == single["num_routed"]  # every rank saw every token


def test_rebalance_mid_decode_changes_no_token(two_rank_runs):
    single, ranks = two_rank_runs
    for rank in ranks:
        static, moving = rank
        assert moving["num_rebalances"] >= 2  # placements switched while requests decoded
        _assert_same_tokens(moving, static, atol=1e-5)
        _assert_same_tokens(moving, single, atol=1e-5)
    assert ranks[0][1]["num_rebalances"] == ranks[1][1]["num_rebalances"]
    assert sum(rank[1]["num_received"] for rank in ranks) > 0  # weights crossed ranks


def test_four_ranks_bitwise_single_process_with_rebalancing(tiny_moe, tmp_path):
    """DeepSeek-V3 (grouped routing, shared expert) on 4 ranks with 4 spare slots, moving
    every 3 steps, in batch-invariant mode: every token and logprob bitwise the same."""
    path = tiny_moe("deepseek_v3")
    single = _generate(path, dict(batch_invariant=True))
    ranks = _run_ep(tmp_path, path, 4, [dict(batch_invariant=True, redundant=4, interval=3)])
    for (result,) in ranks:
        assert result["num_rebalances"] >= 2
        _assert_same_tokens(result, single, atol=0)
    assert sum(result["num_received"] for (result,) in ranks) > 0  # weights crossed ranks


# the device path runs every kernel under triton's interpreter: three prompts, six tokens
DEVICE_PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
DEVICE_ARRIVALS = [0, 0, 1]


def _device_prompts() -> list[list[int]]:
    """The short random prompt and the two of few distinct tokens (skewed routing): each
    program instance of a prompt's kernels is interpreted one by one, so fewer tokens."""
    prompts = _prompts()
    return [prompts[0], prompts[2], prompts[3]]


def _device_path_rank(rank: int, num_ranks: int, path: str, out_dir: str) -> None:
    """On the device path (triton kernels under the interpreter): what decode forwards read
    back, and the tokens of the prompts, with EP on (2 spare slots)."""
    from duplex.kernels import _triton
    from tests.engine.test_triton_backend import decode_read_backs

    def ep(core):
        enable_expert_parallel(core.model, num_redundant=2, interval_steps=NO_REBALANCE)
    with pytest.MonkeyPatch.context() as monkeypatch:
        read_backs = decode_read_backs(path, monkeypatch, setup=ep)
    with _triton.on_cpu():
        core = make_core(path, num_threads=1, max_num_batched_tokens=16, block_size=8)
        ep(core)
        outputs = run_engine(core, _device_prompts(), DEVICE_PARAMS, DEVICE_ARRIVALS)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(dict(read_backs=read_backs, outputs=outputs), fh)


def test_device_path_routes_on_the_device_and_matches_single_process(tiny_moe, tmp_path):
    """Mixtral on 2 ranks through the fused MoE kernels (the GPU path, run by the
    interpreter): routing, the fixed-capacity exchange (empty rows with no expert) and the
    counters read nothing back in a decode forward; tokens equal the single-process
    torch path's, logprobs within fp32 rounding."""
    path = tiny_moe("mixtral")
    core = make_core(path, num_threads=1, max_num_batched_tokens=16, block_size=8)
    single = dict(outputs=run_engine(core, _device_prompts(), DEVICE_PARAMS,  # torch path
                                     DEVICE_ARRIVALS))
    launch(_device_path_rank, 2, path, str(tmp_path))
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["read_backs"] == [[], [], []]
        _assert_same_tokens(got, single, atol=1e-4)
