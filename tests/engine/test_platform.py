"""duplex.engine.platform: device strings resolve (or are refused) in plain words, the CPU shims
do nothing harmlessly, and `place` reaches every tensor of a model."""
import pytest
import torch

from duplex.engine import platform as plat
from duplex.engine.models.moe import ExpertWeights

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")


def test_cpu_and_auto_resolve_to_the_cpu_here():
    cpu = plat.resolve("cpu")
    assert cpu.device == torch.device("cpu") and not cpu.is_cuda
    assert cpu.default_dtype == torch.float32 and cpu.collective_backend == "gloo"
    if not torch.cuda.is_available():
        assert plat.resolve("auto") == cpu
    assert plat.resolve(" CPU ") is plat.cpu()


@no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_is_refused_in_one_line_without_a_device(spec):
    with pytest.raises(plat.PlatformError, match="torch sees no CUDA device") as err:
        plat.resolve(spec)
    assert "\n" not in str(err.value)


def test_unknown_device_is_refused():
    with pytest.raises(plat.PlatformError, match="expected auto, cpu, cuda or cuda:N"):
        plat.resolve("tpu")


def test_cpu_buffers_streams_and_events_are_shims():
    cpu = plat.cpu()
    assert cpu.kv_pool_bytes(12345) == 12345
    host = cpu.empty_host((4,), torch.float32)
    assert not host.is_pinned() and host.device.type == "cpu"
    pool = cpu.zeros((3, 2), torch.int32)
    assert pool.shape == (3, 2) and not pool.any()
    t = torch.arange(3)
    assert cpu.to_device(t) is t  # no copy on the CPU
    stream, event = cpu.copy_stream(), cpu.event()
    with cpu.stream(stream):
        event.record(stream)
        stream.wait_event(event)
    assert event.query() and stream.query()
    event.synchronize()
    cpu.synchronize()
    assert cpu.kernel_backends["fused_moe"] == "torch"


def test_place_reaches_every_tensor():
    class Layer:  # stands in for a model's layer objects
        __module__ = "duplex.engine.models.fake"

        def __init__(self):
            self.weight = torch.ones(2)
            self.experts = [ExpertWeights(torch.ones(1), torch.ones(1))]
            self.caches = {"k": torch.ones(1)}
            self.name = "x"

    class Model:
        __module__ = "duplex.engine.models.fake"

        def __init__(self):
            self.layers = [Layer(), Layer()]
            self.shared = self.layers[0]  # visited once
            self.cos_sin = torch.ones(3)

    meta = plat.Platform(torch.device("meta"), torch.float32, "gloo")
    model = plat.place(Model(), meta)
    found = [model.cos_sin]
    for layer in model.layers:
        found += [layer.weight, *layer.experts[0], layer.caches["k"]]
        assert isinstance(layer.experts[0], ExpertWeights) and layer.name == "x"
    assert model.shared is model.layers[0]
    assert all(t.device.type == "meta" for t in found)


def test_runner_puts_weights_kv_and_step_inputs_on_its_device():
    """A meta 'device' stands in for CUDA: whatever the runner makes must land there."""
    from types import SimpleNamespace

    from duplex.engine.kv_manager import KVTables
    from duplex.engine.model_runner import ModelRunner
    from duplex.engine.scheduler import ScheduledRequest

    class FakeModel:
        __module__ = "duplex.engine.models.fake"

        def __init__(self):
            self.args = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4, vocab_size=8)
            self.embed = torch.ones(8, 4)

    class FakeCudaPlatform(plat.Platform):
        is_cuda = True  # take the device branches

        def empty(self, shape, dtype):
            return torch.empty(shape, dtype=dtype, device=self.device)

        def empty_host(self, shape, dtype):  # no pinned allocator without CUDA
            return torch.empty(shape, dtype=dtype)

        def event(self):
            return plat.NullEvent()

    meta = FakeCudaPlatform(torch.device("meta"), torch.float32, "gloo")
    runner = ModelRunner(FakeModel(), 4, 2, torch.float32, platform=meta)
    assert runner.kv.device.type == "meta" and runner.model.embed.device.type == "meta"
    req = SimpleNamespace(req_id="r", num_computed_tokens=0, num_prompt_tokens=3,
                          num_tokens=3, replay_end=0, token_slice=lambda a, b: [5, 6, 7][a:b])
    tables = KVTables({"r": [2, 0]})
    inputs = runner.prepare([ScheduledRequest(req, 3)], tables)
    ctx = inputs.ctx
    step = [inputs.input_ids, ctx.positions, ctx.slot_mapping, ctx.block_tables,
            ctx.query_start_loc, ctx.seq_lens]
    assert all(t.device.type == "meta" for t in step)
    assert inputs.sample_positions == [2] and ctx.query_lens == [3]
    assert runner.transfer.copies == 1  # all six in one host -> device copy
    runner.prepare([ScheduledRequest(req, 3)], tables)
    assert runner.transfer.copies == 2


def test_step_transfer_lays_mixed_inputs_out_in_one_buffer():
    """Every array comes back equal, with its dtype and shape, as a view of one buffer; on
    the CPU a fresh one each step, so a step's tensors survive the next step's."""
    import numpy as np

    from duplex.engine.model_runner import StepTransfer

    transfer = StepTransfer(plat.cpu())
    arrays = [np.arange(5, dtype=np.int64), np.array([[3, 1], [4, 1], [5, 9]], dtype=np.int32),
              np.zeros(0, dtype=np.int64), np.array([-1, 2**40], dtype=np.int64),
              np.arange(3, dtype=np.int32)]
    first = transfer.move(arrays)
    for a, t in zip(arrays, first):
        assert t.dtype == {np.int32: torch.int32, np.int64: torch.int64}[a.dtype.type]
        assert t.shape == a.shape and t.is_contiguous() and np.array_equal(t.numpy(), a)
    assert len({t.untyped_storage().data_ptr() for t in first}) == 1  # one buffer
    kept = [t.clone() for t in first]
    transfer.move([a + 7 for a in arrays])
    assert all(torch.equal(t, k) for t, k in zip(first, kept))
    assert transfer.copies == 0  # nothing to copy on the CPU


def test_device_flags_are_checked_and_a_gpu_keeps_no_cpu_only_precision():
    from duplex.engine.config import EngineConfig
    from duplex.engine.core import resolve_precision
    from duplex.engine.platform import Platform

    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        EngineConfig.of(device="tpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig.of(gpu_memory_utilization=1.5)
    gpu = Platform(torch.device("cuda", 0), torch.bfloat16, "nccl")  # a description only
    assert resolve_precision(EngineConfig.of(), gpu) == (torch.bfloat16, "none")
    assert resolve_precision(EngineConfig.of(), plat.cpu())[1] == "auto"
    with pytest.raises(ValueError, match="quantized kernels only"):
        resolve_precision(EngineConfig.of(weights_dtype="int4"), gpu)


@pytest.mark.gpu
def test_step_transfer_on_cuda_is_one_copy_from_two_pinned_buffers():
    import numpy as np

    from duplex.engine.model_runner import StepTransfer

    transfer = StepTransfer(plat.resolve("cuda"))
    steps = [[np.arange(4, dtype=np.int64) + i, np.full((2, 3), i, dtype=np.int32)]
             for i in range(5)]
    moved = [transfer.move(arrays) for arrays in steps]
    torch.cuda.synchronize()
    for arrays, tensors in zip(steps, moved):
        assert all(t.is_cuda and np.array_equal(t.cpu().numpy(), a)
                   for a, t in zip(arrays, tensors))
    assert transfer.copies == 5
    assert all(h is not None and h.is_pinned() for h in transfer._host)


@pytest.mark.gpu
def test_to_host_copies_through_pinned_memory_on_the_copy_stream():
    platform = plat.resolve("cuda")
    t = torch.randn(3, 5, 7, device="cuda").movedim(2, 0)  # a strided view, as the tiers'
    host = platform.to_host(t)
    assert host.is_pinned() and torch.equal(host, t.cpu())
    cpu = torch.randn(2, 3)
    assert plat.cpu().to_host(cpu) is cpu  # no copy on the CPU


@pytest.mark.gpu
def test_a_host_copy_is_started_in_pinned_memory_and_waited_for_later():
    t = torch.arange(6, device="cuda") * 3
    copy = plat.HostCopy(t)
    t.add_(1)  # queued after the copy: not in it
    host = copy.wait()
    assert host.is_pinned() and host.tolist() == [0, 3, 6, 9, 12, 15]
    cpu = torch.arange(3)
    assert plat.HostCopy(cpu).wait() is cpu  # a CPU tensor is its own copy
