"""Serving with expert parallelism (engine/ep_group.py): the supervisor's worker forms a group
of N processes (gloo on CPU); outputs equal transformers' greedy tokens, /metrics shows each
rank's load, aborts and deadlines replay on every rank, a killed rank is recovered, and a rank
can join from "another host" through the TCP rendezvous (loopback here)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from duplex.engine.config import EngineConfig
from duplex.engine.messages import AddRequest
from duplex.engine.sampling_params import SamplingParams
from duplex.engine.stats import MoEStats
from duplex.frontend.engine_client import EngineClient
from duplex.frontend.metrics import Metrics
from duplex.frontend.router import Router
from duplex.frontend.supervisor import Supervisor
from tests.moe.conftest import VOCAB

REPO = Path(__file__).resolve().parents[2]
NUM_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(5)
    random = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (11, 30)]
    return {"rand11": random[0], "rand30": random[1], "skew": [7, 7, 8] * 6, "short": [9] * 4}


def _config(path: str, **overrides) -> EngineConfig:
    values = dict(model=path, num_kv_blocks=96, max_model_len=256, max_num_batched_tokens=32,
                  num_threads=1, expert_parallel=2, ep_redundant_experts=2,
                  eplb_interval_steps=3)
    return EngineConfig.of(**{**values, **overrides})


@pytest.fixture(scope="module")
def model_path(tiny_moe) -> str:
    return tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def reference(model_path) -> dict[str, list[int]]:
    """transformers' greedy continuation of each prompt."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path).eval()
    out = {}
    with torch.no_grad():
        for name, prompt in _prompts().items():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False,
                                 min_new_tokens=NUM_NEW, pad_token_id=0)
            out[name] = ids[0, len(prompt):].tolist()
    return out


class Group:
    """A supervised EP worker (rank 0 starts the others) and its client."""

    def __init__(self, config: EngineConfig) -> None:
        self.supervisor = Supervisor(config, use_tcp=True, restart_backoff_s=(0.2, 1.0),
                                     worker_args=["--heartbeat-s", "0.2"], env=ENV)
        self.client = EngineClient(self.supervisor.address, heartbeat_timeout_s=20.0,
                                   router=Router())
        self.supervisor.attach(self.client)

    async def __aenter__(self) -> Group:
        await self.client.start()
        await self.supervisor.start()
        await self.wait_ready()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.supervisor.close(grace_s=10.0)
        await self.client.close()

    async def wait_ready(self, timeout_s: float = 180.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not self.client.workers():
                await asyncio.sleep(0.05)

    async def generate(self, req_id: str, prompt: list[int], params=GREEDY, **fields):
        deltas = [d async for d in self.client.generate(AddRequest(req_id, prompt, params,
                                                                   **fields))]
        return [t for d in deltas for t in d.new_token_ids], deltas[-1]

    def stats(self) -> MoEStats:
        (stats,) = self.client.worker_stats().values()
        return stats.moe


def _children(pid: int) -> list[int]:
    """Child processes of `pid`, whichever of its threads started them."""
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


async def test_two_ranks_equal_transformers_and_report_rank_load(model_path, reference):
    async with Group(_config(model_path)) as group:
        names = list(reference)
        results = await asyncio.gather(*(group.generate(n, _prompts()[n]) for n in names))
        for name, (tokens, final) in zip(names, results):
            assert tokens == reference[name], name
            assert final.finish_reason == "length"
        await asyncio.sleep(0.5)  # a heartbeat after the last step
        moe = group.stats()
        assert moe.ep_ranks == 2
        assert moe.rebalances >= 1  # every 3 steps: placements changed mid-decode
        loads = moe.rank_tokens
        assert len(loads) == 2 and min(loads) > 0
        assert moe.imbalance_max >= moe.imbalance_mean >= 1.0
        metrics = Metrics()
        metrics.update_workers(group.client.worker_stats())
        text = metrics.render().decode()
        for rank, load in enumerate(loads):
            assert f'duplex_moe_rank_load_tokens{{rank="{rank}",worker="unified-0"}} {load}' \
                in text
        assert 'duplex_moe_imbalance{over_layers="max",worker="unified-0"}' in text


async def test_abort_and_deadline_replay_on_every_rank(model_path, reference):
    """An aborted stream and an expired one end on rank 0's word; the followers drop them too
    (a divergence would fail the digest check and the worker), so later requests are exact."""
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with Group(_config(model_path, ep_redundant_experts=0)) as group:
        aborted = asyncio.create_task(group.generate("gone", _prompts()["rand30"], long))
        expired = group.generate("late", _prompts()["skew"], long,
                                 deadline=time.time() + 0.5)
        tokens, final = await expired
        assert final.finish_reason == "abort" and len(tokens) < 200
        aborted.cancel()
        await asyncio.sleep(0.3)
        results = await asyncio.gather(*(group.generate(n, _prompts()[n]) for n in reference))
        assert [tokens for tokens, _ in results] == list(reference.values())
        assert group.client.workers()  # the worker never failed


async def test_host_ram_tier_hits_on_every_rank(model_path):
    """A small pool and a RAM tier: a prompt pushed out of the pool by others comes back from
    host RAM on every rank (the ranks' tiers see the same evictions), with its first tokens."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (100,), generator=gen).tolist() for _ in range(8)]
    config = _config(model_path, num_kv_blocks=48, kv_host_bytes=64 << 20,
                     ep_redundant_experts=0)
    async with Group(config) as group:
        first, _ = await group.generate("a", prompts[0])
        for i, prompt in enumerate(prompts[1:]):  # 7 x 7 blocks: more than the pool holds
            await group.generate(f"other{i}", prompt)
        again, final = await group.generate("a-again", prompts[0])
        assert again == first
        assert final.cached_tokens_by_tier.get("host", 0) >= 80, final.cached_tokens_by_tier


async def test_a_killed_rank_is_recovered(model_path, reference):
    async with Group(_config(model_path, ep_redundant_experts=0)) as group:
        (ready,) = group.client.workers().values()
        (follower,) = _children(ready.pid)
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        stream = asyncio.create_task(group.generate("victim", _prompts()["rand11"], long))
        await asyncio.sleep(1.0)
        os.kill(follower, signal.SIGKILL)
        tokens, final = await asyncio.wait_for(stream, 120)
        # rank 0's next collective fails: the worker reports it and is restarted; the stream
        # is recomputed on the new group (default policy) or ends with one error
        assert final.finish_reason in ("length", "error")
        if final.finish_reason == "error":
            assert "expert-parallel group broke" in final.error
        async with asyncio.timeout(180):
            while True:
                workers = group.client.workers()
                if workers and next(iter(workers.values())).pid != ready.pid:
                    break
                await asyncio.sleep(0.1)
        tokens, final = await group.generate("after", _prompts()["short"])
        assert tokens == reference["short"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join(model_path: str, master: str, *extra: str) -> subprocess.Popen:
    """`duplex worker --ep-rank 1`, as an operator would start it on another host."""
    return subprocess.Popen(
        [sys.executable, "-m", "duplex.frontend.cli", "worker", "--ep-rank", "1", "--expert-parallel",
         "2", "--ep-master", master, "--model", model_path, "--num-kv-blocks", "96",
         "--max-model-len", "256", "--max-num-batched-tokens", "32", "--num-threads", "1",
         "--ep-redundant-experts", "2", "--eplb-interval-steps", "3", *extra],
        cwd=REPO, env={**os.environ, **ENV}, stderr=subprocess.PIPE, text=True)


async def test_a_rank_joins_through_the_rendezvous(model_path, reference):
    master = f"127.0.0.1:{_free_port()}"
    joiner = _join(model_path, master)
    try:
        async with Group(_config(model_path, ep_local_ranks=1, ep_master=master)) as group:
            tokens, _ = await group.generate("rand30", _prompts()["rand30"])
            assert tokens == reference["rand30"]
        assert joiner.wait(timeout=60) == 0  # left on the leader's stop order
    finally:
        joiner.kill()


async def test_a_rank_with_another_configuration_is_refused(model_path):
    master = f"127.0.0.1:{_free_port()}"
    joiner = _join(model_path, master, "--max-num-seqs", "7")
    try:
        config = _config(model_path, ep_local_ranks=1, ep_master=master)
        supervisor = Supervisor(config, use_tcp=True, restart_backoff_s=(30.0, 30.0), env=ENV)
        client = EngineClient(supervisor.address, router=Router())
        await client.start()
        await supervisor.start()
        async with asyncio.timeout(120):
            while not supervisor.status()[0].last_exit:
                await asyncio.sleep(0.1)
        await supervisor.close()
        await client.close()
        status = supervisor.status()[0]
        # a failure before the first step: the start-up exit code, and no restart loop
        assert "exited with code 3" in status.last_exit
        assert (status.state, status.num_restarts) == ("failed", 0)
        _, err = joiner.communicate(timeout=60)
        assert "disagree on the model and engine configuration" in err
    finally:
        joiner.kill()


def test_options_that_depend_on_timing_are_refused():
    for field, value in (("kv_dir", "/tmp/x"), ("step_budget_ms", 50.0),
                         ("speculation", "ngram")):
        with pytest.raises(ValueError, match=f"{field} is not supported with expert_parallel"):
            EngineConfig.of(expert_parallel=2, **{field: value})
    with pytest.raises(ValueError, match="ep_local_ranks"):
        EngineConfig.of(expert_parallel=2, ep_local_ranks=3)


def test_an_engine_outside_a_group_is_refused(model_path):
    from duplex.engine.core import EngineCore

    with pytest.raises(ValueError, match="duplex serve"):
        EngineCore(_config(model_path))


def test_serve_refuses_expert_parallel_with_a_split(capsys):
    from duplex.frontend.cli import main

    assert main(["serve", "--expert-parallel", "2", "--prefill-workers", "1",
                 "--decode-workers", "1"]) == 2
    assert "cannot be combined" in capsys.readouterr().err


def _order_and_disagree(rank: int, master: str, out_dir: str) -> None:
    from duplex.engine.ep_group import RankGroup, RanksDisagree, StepOrder
    from duplex.engine.messages import AbortRequests

    group = RankGroup(EngineConfig.of(expert_parallel=2, ep_master=master), rank)
    sent = StepOrder([AddRequest("a", [1, 2], GREEDY, deadline=0.0), AbortRequests(["b"])])
    order = group.broadcast_order(sent if rank == 0 else None)
    group.check_same("a digest", b"same0000")
    try:
        group.check_same("the step's tokens", bytes([rank]) * 8)
        outcome = "no error"
    except RanksDisagree as e:
        outcome = str(e)
    Path(out_dir, f"rank{rank}.txt").write_text(f"{order == sent}\n{outcome}")
    group.close()


def test_orders_arrive_intact_and_a_divergence_is_an_error(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_order_and_disagree, args=(f"127.0.0.1:{_free_port()}", str(tmp_path)), nprocs=2)
    for rank in range(2):
        same, outcome = (tmp_path / f"rank{rank}.txt").read_text().split("\n")
        assert same == "True"
        assert outcome == "expert-parallel ranks disagree on the step's tokens (ranks [1] " \
                          "differ from rank 0)"


@pytest.mark.slow
def test_duplex_serve_expert_parallel_end_to_end(model_path, reference, tmp_path):
    """`duplex serve --expert-parallel 2`: OpenAI SDK completions equal transformers' tokens,
    /metrics has both ranks' load, SIGTERM stops every rank."""
    import select
    import shutil

    import openai
    import requests

    from tests.moe.conftest import add_word_tokenizer

    model_dir = tmp_path / "model"
    shutil.copytree(model_path, model_dir)
    add_word_tokenizer(model_dir)
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "duplex.frontend.cli", "serve", "--model", str(model_dir), "--port",
         str(port), "--expert-parallel", "2", "--ep-redundant-experts", "2",
         "--eplb-interval-steps", "3", "--num-kv-blocks", "96", "--max-model-len", "256"],
        cwd=REPO, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, start_new_session=True)
    try:
        # a bounded wait: a rank that dies during start-up must fail the test, not hang it
        ready, _, _ = select.select([server.stdout], [], [], 300)
        assert ready, "duplex serve printed no banner in 300 s"
        banner = server.stdout.readline()
        assert "unified over 2 expert-parallel ranks" in banner, banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        for name in ("rand30", "skew"):
            prompt = " ".join(f"w{t}" for t in _prompts()[name])
            done = client.completions.create(model="model", prompt=prompt, max_tokens=NUM_NEW,
                                             temperature=0, extra_body={"ignore_eos": True})
            want = [f"w{t}" for t in reference[name] if t > 1]  # 0 and 1 are special
            assert done.choices[0].text.split() == want, name
            assert done.usage.completion_tokens == NUM_NEW
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for rank in (0, 1):
            # labels sort by name: /metrics adds model_name (frontend/metrics.py) first
            assert re.search(rf'duplex_moe_rank_load_tokens{{model_name="[^"]+",rank="{rank}",'
                             r'worker="unified-0"}', text)
        assert "duplex_moe_imbalance{" in text and "duplex_moe_rebalances{" in text
        leader = _children(server.pid)
        ranks = leader + [c for pid in leader for c in _children(pid)]
        assert len(ranks) == 2
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        for pid in ranks:
            assert not Path(f"/proc/{pid}").exists() or \
                Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
