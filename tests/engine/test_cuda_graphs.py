"""engine/cuda_graphs.py: which steps a decode graph takes (every row one decode query, no
prompt token, within the captured sizes and context) and, on CUDA, captured graphs that
replay to the eager steps' tokens. The padded static-buffer path itself is checked on the
CPU under triton's interpreter in tests/engine/test_triton_backend.py."""
from __future__ import annotations

import pytest
import torch

from duplex.engine.cuda_graphs import DecodeGraphs
from duplex.kernels import _triton
from duplex.engine.messages import AddRequest
from duplex.engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core, run_engine
from tests.engine.test_tiny_models import build_tiny

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return build_tiny(tmp_path_factory, "llama")


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def graphs_of(core, capture: bool, max_batch: int = 6, max_len: int | None = None):
    return DecodeGraphs(core.model, core.runner.kv_caches, core.block_size,
                        max_len or core.max_model_len, core.platform, max_batch, capture)


@pytest.mark.skipif(not (_triton.HAS_TRITON and _triton.is_interpreter()),
                    reason="needs triton's interpreter (TRITON_INTERPRET=1, no CUDA)")
def test_only_whole_decode_steps_within_the_captured_shapes_take_a_graph(llama):
    with _triton.on_cpu():  # the device kernel path, which the graphs need
        check_which_steps_take_a_graph(make_core(llama, block_size=8))
    assert graphs_of(make_core(llama), capture=False).run(*cpu_decode_inputs(llama)) is None


def cpu_decode_inputs(path: str):
    """A decode step's inputs on the plain CPU path."""
    core = make_core(path)
    core.add_request(AddRequest("a", tokens(5, 1), SamplingParams(max_tokens=4)))
    core.step()
    inputs = core.runner.prepare(core.scheduler.schedule().scheduled, core.kv.tables)
    return inputs.input_ids, inputs.ctx, inputs.computes_prompt


def check_which_steps_take_a_graph(core):
    graphs = graphs_of(core, capture=False, max_batch=2, max_len=16)
    assert graphs.sizes == [1, 2]
    seen, execute = [], core.runner.execute

    def spy(inputs, rows=None):  # would the graphs take this step? (then run it for real)
        ran = graphs.run(inputs.input_ids, inputs.ctx, inputs.computes_prompt)
        seen.append((len(inputs.ctx.query_lens), max(inputs.ctx.host_seq_lens),
                     ran is not None))
        out = execute(inputs, rows)
        if ran is not None:  # the padded static-buffer step gives the step's logits
            torch.testing.assert_close(ran, out, rtol=0, atol=1e-4)
        return out
    core.runner.execute = spy
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    core.add_request(AddRequest("a", tokens(5, 1), params))
    while core.requests:
        core.step()
        if len(seen) == 3:  # two more rows: a step of three is past the largest size
            for name in "bc":
                core.add_request(AddRequest(name, tokens(3, ord(name)), params))
    assert seen[0] == (1, 5, False)  # the prompt step
    assert seen[1:3] == [(1, 6, True), (1, 7, True)]  # decodes
    assert all(not ran for rows, _, ran in seen if rows > 2)
    assert all(not ran for _, max_len, ran in seen if max_len > 16)
    assert any(ran for rows, _, ran in seen if rows == 2)  # two rows: the size-2 graph
    assert graphs.replays == sum(ran for _, _, ran in seen)


def captured_against_eager(path: str, seed: int):
    """(eager core, graphed core) after the same three prompts on CUDA, the graphed one's
    decode steps replayed from captured graphs; greedy tokens equal, logprobs within 1e-3."""
    prompts = [tokens(n, seed + n) for n in (5, 9, 14)]
    eager = make_core(path, device="cuda")
    reference = run_engine(eager, prompts, GREEDY)
    core = make_core(path, device="cuda")
    core.runner.graphs = graphs_of(core, capture=True)
    got = run_engine(core, prompts, GREEDY)
    assert core.runner.graphs.replays >= 4
    for name, (ids, logprobs) in reference.items():
        assert got[name][0] == ids
        torch.testing.assert_close(got[name][1], logprobs, rtol=0, atol=1e-3)
    return eager, core


@pytest.mark.gpu
def test_captured_decode_graphs_give_the_eager_tokens(llama):
    """On CUDA: the captured graphs replayed, greedy tokens equal to eager steps'."""
    captured_against_eager(llama, seed=30)


@pytest.mark.gpu
def test_captured_graphs_of_a_moe_model(tmp_path_factory):
    """On CUDA: Mixtral's decode steps captured (routing, the fused MoE kernels and the
    in-place expert counters inside the graph) replay to the eager tokens, and the expert
    load leaves the padding rows out."""
    from tests.moe.conftest import build_tiny_moe
    path = build_tiny_moe(tmp_path_factory.mktemp("mixtral_cuda_graphs"), "mixtral")
    eager, core = captured_against_eager(path, seed=50)
    assert core.model.expert_load().expert_load.sum() == eager.model.expert_load().expert_load.sum()
