"""The engine's device kernel path, run on the CPU: inside kernels._triton.on_cpu, kernels.ops
sends every op that has a triton kernel (the KV store, varlen prefill and split-KV decode
attention, RMSNorm, rotary, SiLU-and-mul) through it, under triton's interpreter. The whole
engine then runs on those kernels: its greedy tokens equal the torch path's, with chunked
mixed steps, prefix-cache hits, n-gram speculation and the hybrid KV layout of a
sliding-window model; and a decode step's forward reads no value back to the host."""
from __future__ import annotations

import collections

import pytest
import torch

from duplex.engine.hybrid_kv import HybridKVCacheManager
from duplex.engine.messages import AddRequest
from duplex.engine.sampling_params import SamplingParams
from duplex.kernels import _triton, activation, decode_attention, kv_store, rms_norm, rotary
from tests.engine.conftest import make_core, run_engine
from tests.engine.test_tiny_models import build_tiny
from tests.readbacks import ReadBacks
from tests.models_swa.test_swa_greedy import build_tiny as build_swa

pytestmark = pytest.mark.skipif(not (_triton.HAS_TRITON and _triton.is_interpreter()),
                                reason="needs triton's interpreter (TRITON_INTERPRET=1, no CUDA)")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
LAUNCHERS = [(kv_store, "store_kv_triton"),
             (decode_attention, "paged_attention_triton"),  # a step's multi-query rows
             (decode_attention, "decode_attention_triton"),  # its decode rows, split-KV
             (rms_norm, "rms_norm_triton"), (rotary, "rotary_embedding_triton"),
             (activation, "silu_and_mul_triton")]


@pytest.fixture
def launches(monkeypatch) -> collections.Counter:
    """Calls of each triton launcher kernels.ops reaches."""
    calls = collections.Counter()
    for module, name in LAUNCHERS:
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


def both_paths(path: str, run, **config) -> tuple:
    """run(core) on the torch path and on the triton path, each on a fresh engine."""
    reference = run(make_core(path, **config))
    with _triton.on_cpu():
        return reference, run(make_core(path, **config))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return build_tiny(tmp_path_factory, "llama")


def test_mixed_steps_and_prefix_hits_give_the_torch_paths_tokens(llama, launches):
    prompts = [tokens(5, 1), tokens(19, 2), tokens(30, 3)]

    def run(core):
        first = run_engine(core, prompts, GREEDY, arrivals=[0, 0, 1])
        again = prompts[2] + first["r2"][0] + tokens(4, 4)  # the next turn: a prefix hit
        core.add_request(AddRequest("turn2", again, GREEDY))
        out, cached = [], 0
        while core.has_unfinished_requests():
            for d in core.step():
                out += d.new_token_ids
                cached += d.num_cached_tokens
        return {k: v[0] for k, v in first.items()}, out, cached

    reference, got = both_paths(llama, run, block_size=8, max_num_batched_tokens=16)
    assert got == reference
    assert got[2] >= 32  # the turn reused the first conversation's full blocks
    for _, name in LAUNCHERS:
        assert launches[name] > 0, f"{name} never ran"


def test_speculation_gives_the_torch_paths_tokens(llama):
    loop = tokens(6, 5) * 5  # a repeating prompt: n-gram drafts that are accepted

    def run(core):
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        out = run_engine(core, [loop], params)["r0"][0]
        return out, core.stats().spec.num_draft_proposed

    reference, got = both_paths(llama, run, block_size=8, speculation="ngram",
                                spec_confidence=False, spec_token_cost=0.05)
    assert got[0] == reference[0]
    assert got[1] > 0


def test_the_hybrid_kv_layout_gives_the_torch_paths_tokens(tmp_path, launches):
    path = build_swa("mistral", str(tmp_path))
    prompt = tokens(30, 6)

    def run(core):
        assert isinstance(core.kv, HybridKVCacheManager)
        return run_engine(core, [prompt], GREEDY)["r0"][0]

    reference, got = both_paths(path, run, block_size=8, num_kv_blocks=64)
    assert got == reference
    assert launches["decode_attention_triton"] > 0


def test_a_decode_step_of_the_device_path_reads_nothing_back(llama, monkeypatch):
    """The forward and the logits of decode steps (everything but the sampler's one read of
    the new tokens) on the triton path: not one value read back to the host."""
    with ReadBacks(monkeypatch) as control:  # the counter sees every kind
        torch.ones(2).sum().item(), torch.ones(2).tolist()
        with torch.inference_mode():  # a step's tensors
            t = torch.ones(2)
            int(t.max()), float(t.sum()), bool(t.any()), t[0].item()
            torch.bincount(t.long()), t[t > 0], t.nonzero()  # sized by the data
    assert control.count >= 9
    assert decode_read_backs(llama, monkeypatch) == [[], [], []]


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_a_moe_decode_step_reads_nothing_back(arch, tmp_path_factory, monkeypatch):
    """Routing, the fused MoE kernels' alignment and the load counters stay on the device
    (torch.bincount, which CUDA sizes by reading the max back, is not used)."""
    from tests.moe.conftest import build_tiny_moe
    path = build_tiny_moe(tmp_path_factory.mktemp(arch), arch)
    assert decode_read_backs(path, monkeypatch) == [[], [], []]


def decode_read_backs(path: str, monkeypatch, setup=None) -> list[list[str]]:
    """What each of three decode steps' forward and logits read back to the host (or sized by
    the data), on the triton path, two requests decoding. `setup(core)` runs first."""
    with _triton.on_cpu():
        core = make_core(path, block_size=8)
        if setup is not None:
            setup(core)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        core.add_request(AddRequest("a", tokens(11, 7), params))
        core.add_request(AddRequest("b", tokens(25, 8), params))
        while any(r.num_output_tokens < 2 for r in core.requests.values()):
            core.step()
        execute, counts = core.runner.execute, []

        def counted(*args, **kwargs):
            with ReadBacks(monkeypatch) as reads:
                out = execute(*args, **kwargs)
            counts.append(reads.ops)
            return out
        core.runner.execute = counted
        for _ in range(3):
            core.step()
    return counts


def test_a_moe_model_routes_through_the_fused_moe_kernel(tmp_path_factory, launches,
                                                         monkeypatch):
    """Mixtral on the device path: every MoE layer runs the grouped-GEMM triton kernels
    (kernels.fused_moe) instead of the CPU's per-expert loop; greedy tokens equal, logprobs
    within fp32 rounding (the grouped GEMM sums in another order)."""
    from duplex.kernels import fused_moe
    from tests.moe.conftest import build_tiny_moe

    calls = []
    real = fused_moe.fused_moe_triton
    monkeypatch.setattr(fused_moe, "fused_moe_triton",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    path = build_tiny_moe(tmp_path_factory.mktemp("mixtral"), "mixtral")
    prompts = [tokens(7, 11), tokens(12, 12)]
    reference, got = both_paths(path, lambda core: run_engine(core, prompts, GREEDY))
    assert calls
    for name, (ids, logprobs) in reference.items():
        assert got[name][0] == ids
        torch.testing.assert_close(got[name][1], logprobs, rtol=0, atol=1e-4)


def test_mla_decodes_through_the_mla_kernel(tmp_path_factory, monkeypatch):
    """DeepSeek-V3 (MLA over the latent cache, grouped routing) on the device path: decode
    rows through the split-KV MLA kernel (kernels.mla_decode), greedy tokens equal to the
    torch path's, logprobs within fp32 rounding (other summation orders)."""
    from duplex.engine.models import deepseek_v3
    from tests.moe.conftest import build_tiny_moe

    calls = []
    real = deepseek_v3.mla_decode_triton
    monkeypatch.setattr(deepseek_v3, "mla_decode_triton",
                        lambda *a, **k: calls.append(k["max_seq_len"]) or real(*a, **k))
    path = build_tiny_moe(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3")
    prompts = [tokens(7, 13), tokens(12, 14)]
    reference, got = both_paths(path, lambda core: run_engine(core, prompts, GREEDY))
    assert calls and all(n is not None for n in calls)  # sized by the host: no sync
    for name, (ids, logprobs) in reference.items():
        assert got[name][0] == ids
        torch.testing.assert_close(got[name][1], logprobs, rtol=0, atol=1e-4)


def test_an_mla_moe_decode_step_reads_nothing_back(tmp_path_factory, monkeypatch):
    """DeepSeek-V3's decode steps on the triton path (MLA kernel, grouped routing, fused MoE):
    not one value read back to the host either."""
    from tests.moe.conftest import build_tiny_moe
    path = build_tiny_moe(tmp_path_factory.mktemp("deepseek_v3_sync"), "deepseek_v3")
    assert decode_read_backs(path, monkeypatch) == [[], [], []]


def graphed(core, capture: bool):
    """core with decode steps through engine.cuda_graphs (capture=False: its static buffers
    and padding, run eagerly, as on the CPU)."""
    from duplex.engine.cuda_graphs import DecodeGraphs
    core.runner.graphs = DecodeGraphs(core.model, core.runner.kv_caches, core.block_size,
                                      core.max_model_len, core.platform, max_batch=6,
                                      capture=capture)
    return core


def test_decode_steps_through_the_graphs_static_buffers(llama, launches):
    """The decode-graph path on the device kernels (padded to a captured size, the attention
    grid sized for the graphs' longest context, inputs copied into static buffers): greedy
    tokens equal to the plain torch path's, logprobs within rounding; prefill and mixed steps
    still run eagerly."""
    prompts = [tokens(n, 20 + n) for n in (5, 9, 14)]  # 3 rows: padded to a batch of 4
    cores = []

    def run(core):
        cores.append(graphed(core, capture=False))
        return run_engine(core, prompts, GREEDY)

    reference = run_engine(make_core(llama), prompts, GREEDY)  # the torch path
    with _triton.on_cpu():
        got = run(make_core(llama))
    assert cores[0].runner.graphs.replays >= 4  # the decode steps went through it
    for name, (ids, logprobs) in reference.items():
        assert got[name][0] == ids
        torch.testing.assert_close(got[name][1], logprobs, rtol=0, atol=1e-4)



def test_a_moe_model_through_the_graphs_static_buffers(tmp_path_factory):
    """Mixtral's decode steps through the graph path: tokens equal to the plain path's, and
    the expert load counts the real rows only (a batch of 3 padded to 4 routes its padding
    row too; the statistics leave it out, as they must in a replayed graph)."""
    from tests.moe.conftest import build_tiny_moe
    path = build_tiny_moe(tmp_path_factory.mktemp("mixtral_graphs"), "mixtral")
    prompts = [tokens(n, 40 + n) for n in (5, 9, 14)]
    plain = make_core(path)  # the torch path (the interpreter runs only the graphed one)
    reference = run_engine(plain, prompts, GREEDY)
    with _triton.on_cpu():
        core = graphed(make_core(path), capture=False)
        got = run_engine(core, prompts, GREEDY)
    assert core.runner.graphs.replays >= 4
    for name, (ids, logprobs) in reference.items():
        assert got[name][0] == ids
        torch.testing.assert_close(got[name][1], logprobs, rtol=0, atol=1e-4)
    load, want = core.model.expert_load().expert_load, plain.model.expert_load().expert_load
    assert load.sum() == want.sum() > 0
