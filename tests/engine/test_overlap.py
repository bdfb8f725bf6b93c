"""Overlapped scheduling (engine/core.py, `--overlap`): step n+1 is scheduled and launched
before step n's tokens are read, each sampled request carrying a placeholder whose id the
next step takes from the device. It must change nothing a client sees: the same tokens,
logprobs, finish reasons and cached-token counts as the step-by-step engine, through chunked
prefill, late arrivals, stop tokens, prefix hits, preemption, aborts, the hybrid KV layout
and the device kernel path, where each step's one read comes after the next step's launch.
"""
from __future__ import annotations

import pytest
import torch

from duplex.engine import sampler as sampler_module
from duplex.engine.config import EngineConfig, SpecConfig
from duplex.engine.core import resolve_overlap
from duplex.engine.messages import AddRequest, FinishReason
from duplex.engine.platform import cpu
from duplex.engine.request import PENDING, Request
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.scheduler import ends_by_length
from duplex.kernels import _triton
from tests.engine.conftest import make_core
from tests.engine.test_tiny_models import build_tiny
from tests.models_swa.test_swa_greedy import build_tiny as build_swa
from tests.readbacks import ReadBacks

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True,
                        logprobs=1)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return build_tiny(tmp_path_factory, "llama")


def drive(core, requests: list[tuple[int, AddRequest]], abort: dict | None = None) -> dict:
    """Add each request before the step it arrives at, abort {req_id: step} ones, and step
    to the end: per request its tokens, logprobs (ids and values), finish reason and cached
    tokens, from the deltas alone. Also checks that no delta follows a final one."""
    out: dict[str, dict] = {}
    abort, step = abort or {}, 0
    while step <= max(at for at, _ in requests) or core.has_unfinished_requests():
        for at, msg in requests:
            if at == step:
                core.add_request(msg)
                out[msg.req_id] = dict(tokens=[], logprobs=[], finish=None, cached=None)
        core.abort_requests([req_id for req_id, at in abort.items() if at == step])
        for d in core.step():
            got = out[d.req_id]
            assert got["finish"] is None, f"{d.req_id}: a delta after its final one"
            got["tokens"] += d.new_token_ids
            got["logprobs"] += [(lp.token_id, lp.logprob, lp.top) for lp in d.logprobs]
            if d.finish_reason:
                got["finish"], got["cached"] = d.finish_reason, d.num_cached_tokens
        step += 1
        assert step < 500, "the engine did not finish"
    return out


def assert_same(got: dict, want: dict, exact: bool = False) -> None:
    """The same tokens, finish reasons, cached tokens and logprob ids; logprob values equal
    (exact) or within fp32 rounding (a step's batch differs by the rows of requests that
    stopped in flight, so its matmuls may round differently, as in any batch change)."""
    assert got.keys() == want.keys()
    for req_id, ref in want.items():
        out = got[req_id]
        assert [out[k] for k in ("tokens", "finish", "cached")] == \
            [ref[k] for k in ("tokens", "finish", "cached")], req_id
        ids = [(t, [i for i, _ in top]) for t, _, top in out["logprobs"]]
        assert ids == [(t, [i for i, _ in top]) for t, _, top in ref["logprobs"]], req_id
        values = [[v, *(x for _, x in top)] for _, v, top in out["logprobs"]]
        expected = [[v, *(x for _, x in top)] for _, v, top in ref["logprobs"]]
        if exact:
            assert values == expected, req_id
        else:
            for a, b in zip(values, expected):
                assert a == pytest.approx(b, abs=1e-4), req_id


def both(path: str, requests, abort=None, **config) -> tuple[dict, dict, int]:
    """drive() step by step and overlapped on fresh engines: (sync, overlapped, how many
    overlapped steps were read after the next one was launched)."""
    sync = drive(make_core(path, overlap="off", **config), requests, abort)
    core = make_core(path, overlap="on", **config)
    assert core.overlap
    late = count_late_reads(core)
    return sync, drive(core, requests, abort), late


def count_late_reads(core) -> list:
    """Wrap the core's sampler so that the returned list's length counts the steps whose
    tokens were read after a later step had been launched."""
    launched, late = [], []
    launch = core.sampler.launch

    def tracked(*args, **kwargs):
        draws = launch(*args, **kwargs)
        number, result = len(launched), draws.result
        launched.append(number)

        def read():
            if len(launched) > number + 1:
                late.append(number)
            return result()
        draws.result = read
        return draws
    core.sampler.launch = tracked
    return late


def stop_on_a_generated_token(path: str, prompt: list[int]) -> int:
    """A token the engine draws for `prompt` around the middle of its output (a stop token
    that ends it early)."""
    ref = drive(make_core(path, overlap="off"), [(0, AddRequest("probe", prompt, GREEDY))])
    return ref["probe"]["tokens"][4]


def test_overlapped_steps_give_the_tokens_of_the_step_by_step_engine(llama):
    stop = stop_on_a_generated_token(llama, tokens(9, 3))
    stopped = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop], logprobs=0)
    shared = tokens(24, 5)
    requests = [(0, AddRequest("greedy", tokens(5, 1), GREEDY)),
                (0, AddRequest("seeded", tokens(17, 2), SEEDED)),
                (1, AddRequest("stopped", tokens(9, 3), stopped)),
                (2, AddRequest("one", tokens(6, 4), SamplingParams(temperature=0, max_tokens=1))),
                (3, AddRequest("long", tokens(40, 6), GREEDY)),  # chunked: 16 tokens a step
                (4, AddRequest("first", shared + tokens(3, 7), GREEDY)),
                (9, AddRequest("hit", shared + tokens(5, 8), GREEDY))]  # its prefix cached
    sync, overlapped, late = both(llama, requests, block_size=8, max_num_batched_tokens=16)
    assert_same(overlapped, sync)
    assert sync["stopped"]["finish"] == FinishReason.STOP and len(sync["stopped"]["tokens"]) < 10
    assert sync["one"]["tokens"] and sync["hit"]["cached"] == 24
    assert len(late) >= 10  # the steps did overlap


def test_in_batch_invariant_mode_the_logprobs_are_bitwise_the_same(llama):
    stop = stop_on_a_generated_token(llama, tokens(9, 3))
    requests = [(0, AddRequest("a", tokens(5, 1), GREEDY)),
                (0, AddRequest("b", tokens(9, 3), SamplingParams(
                    temperature=0, max_tokens=10, stop_token_ids=[stop], logprobs=3))),
                (2, AddRequest("c", tokens(13, 2), SEEDED))]
    sync, overlapped, late = both(llama, requests, batch_invariant=True)
    assert_same(overlapped, sync, exact=True)
    assert late


def test_a_pool_too_small_for_everyone_preempts_the_same_way(llama):
    """Preemption under overlap: a victim may carry a placeholder; it is readmitted only
    once that token landed, and recomputes to the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    requests = [(0, AddRequest(f"r{i}", tokens(11 + i, 20 + i), params)) for i in range(4)]
    sync, overlapped, late = both(llama, requests, block_size=8, num_kv_blocks=8)
    assert_same(overlapped, sync)
    assert late
    core = make_core(llama, overlap="on", block_size=8, num_kv_blocks=8)
    drive(core, requests)
    assert core.scheduler.num_preemptions > 0
    assert core.pool.num_used_blocks == 0


def test_an_abort_while_its_step_flies_ends_it_once_and_spares_the_others(llama):
    """The aborted request's token still in flight is never delivered (its client saw the
    tokens before it, then the abort); the others go on as without it."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = [(0, AddRequest(name, tokens(7, i), params)) for i, name in enumerate("abc")]
    sync, overlapped, _ = both(llama, requests, abort={"b": 4})
    aborted, ref = overlapped.pop("b"), sync.pop("b")
    assert_same(overlapped, sync)
    assert aborted["finish"] == ref["finish"] == FinishReason.ABORT
    assert aborted["tokens"] == ref["tokens"][:len(aborted["tokens"])]
    assert 0 < len(aborted["tokens"]) < 12 and len(overlapped["a"]["tokens"]) == 12


def test_penalties_make_each_step_wait_for_its_tokens(llama):
    """A request whose next draw counts its tokens on the host (penalties) turns overlap off
    while it runs: still the same tokens, and no step read late while it ran."""
    penalized = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                               repetition_penalty=1.3, frequency_penalty=0.5)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    requests = [(0, AddRequest("p", tokens(8, 1), penalized)),
                (0, AddRequest("q", tokens(6, 2), plain))]  # ends with p
    sync, overlapped, late = both(llama, requests)
    assert_same(overlapped, sync, exact=True)  # the same steps
    assert not late


def test_the_hybrid_kv_layout_of_a_sliding_window_model(tmp_path):
    path = build_swa("gemma3", str(tmp_path))
    shared = tokens(30, 9)
    requests = [(0, AddRequest("a", shared + tokens(4, 1), GREEDY)),
                (0, AddRequest("b", tokens(21, 2), SEEDED)),
                (8, AddRequest("c", shared + tokens(6, 3), GREEDY))]
    sync, overlapped, late = both(path, requests, block_size=8)
    assert_same(overlapped, sync)
    assert late


def test_the_device_path_reads_a_step_after_launching_the_next_and_nowhere_else(llama,
                                                                               monkeypatch):
    """On the triton path (what runs on a GPU): over three overlapped decode steps the host
    reads back three times, each a step's packed draws, each after the next step's forward
    was queued; scheduling, inputs, forward and draws read nothing."""
    with _triton.on_cpu():
        core = make_core(llama, block_size=8, overlap="on")
        for name, n in (("a", 11), ("b", 25)):
            core.add_request(AddRequest(name, tokens(n, n), SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True)))
        for _ in range(3):
            core.step()
        events, execute, result = [], core.runner.execute, sampler_module.Draws.result
        monkeypatch.setattr(core.runner, "execute",
                            lambda *a, **k: events.append("forward") or execute(*a, **k))
        monkeypatch.setattr(sampler_module.Draws, "result",
                            lambda self: events.append("read") or result(self))
        with ReadBacks(monkeypatch) as reads:
            for _ in range(3):
                assert core._in_flight is not None  # a step is always on the device
                core.step()
    assert reads.reads == ["tolist"] * 3, reads.ops
    assert events == ["forward", "read"] * 3  # step n is read after step n+1's forward


def test_placeholders_land_in_order_and_a_finish_drops_the_rest():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), eos_token_ids=(9,),
                  max_tokens=4)
    assert req.add_token(5) == 0
    req.add_token(PENDING)
    req.add_token(PENDING)
    assert (req.num_pending, req.num_tokens, req.output_token_ids) == (2, 6, [5, -1, -1])
    assert req.add_token(9) == 1 and req.output_token_ids == [5, 9, -1]
    stop = req.check_stop(64, index=1)
    assert stop == (FinishReason.STOP, None) and req.finish_reason is None
    req.finish(*stop)
    assert req.finish_reason == FinishReason.STOP
    assert req.output_token_ids == [5, 9] and req.num_pending == 0


def test_a_request_ended_by_length_in_flight_is_not_scheduled_again():
    req = Request("r", [1, 2], SamplingParams(max_tokens=2), max_tokens=2)
    req.add_token(4)
    assert not ends_by_length(req, 64)
    req.add_token(PENDING)
    assert ends_by_length(req, 64)  # whatever the id, its second token ends it
    assert ends_by_length(Request("s", [1] * 63, SamplingParams(), max_tokens=8), 63)


def test_overlap_is_on_by_default_only_on_a_gpu_and_never_with_speculation():
    assert not resolve_overlap(EngineConfig(), cpu())
    assert resolve_overlap(EngineConfig(overlap="on"), cpu())
    assert not resolve_overlap(EngineConfig(overlap="off"), cpu())
    speculating = EngineConfig(overlap="auto", spec=SpecConfig(speculation="ngram"))
    assert not resolve_overlap(speculating, cpu())
    for bad in (dict(overlap="sometimes"), dict(overlap="on", speculation="ngram"),
                dict(overlap="on", expert_parallel=2)):
        with pytest.raises(ValueError, match="overlap"):
            EngineConfig.of(**bad)


@pytest.mark.gpu
def test_on_cuda_overlap_is_on_by_default_and_gives_the_same_tokens(llama):
    from duplex.engine.platform import resolve

    def run(overlap: str):
        core = make_core(llama, device="cuda", overlap=overlap)
        assert core.overlap == (overlap == "auto")
        late = count_late_reads(core)
        return drive(core, [(0, AddRequest("a", tokens(9, 1), GREEDY)),
                            (1, AddRequest("b", tokens(30, 2), SEEDED))]), late

    assert resolve_overlap(EngineConfig(), resolve("cuda"))
    (overlapped, late), (sync, _) = run("auto"), run("off")
    assert_same(overlapped, sync)
    assert late


def test_the_flag_reaches_a_worker_process_config():
    """`--overlap on` on the command line, through the JSON a worker process decodes its
    config from (engine/worker_cli.py)."""
    import argparse

    import msgspec

    from duplex.engine.args import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["--overlap", "on"]))
    sent = msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig)
    assert sent.overlap == "on" and resolve_overlap(sent, cpu())
    with pytest.raises(SystemExit):
        parser.parse_args(["--overlap", "maybe"])
