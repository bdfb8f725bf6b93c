"""The platform: which device the engine runs on and everything that follows from it.

One frozen `Platform`, resolved once from a device string, decides

    device              cpu, or one CUDA device
    default dtype       float32 on the CPU (the exact mode), bfloat16 on a GPU
    KV pool size        CPU: the configured bytes; CUDA: a fraction of the device's memory
                        (torch.cuda.mem_get_info) minus what is already in use
    host buffers        pinned on CUDA (fast, asynchronous copies), huge-page advised on CPU
    streams, events     a side stream for copies (KV tiers, transfer) and events to order
                        them; no-op shims on the CPU, where every copy is synchronous
    collectives         torch.distributed backend: nccl on CUDA, gloo on CPU
    kernel backends     what kernels.ops runs for each op on this device (`kernel_backends`)

The device string is `auto | cpu | cuda | cuda:N`; auto is CUDA when torch sees a device.
Everything else takes the platform (or a tensor's device) instead of naming a device.
`place` moves a loaded model's tensors onto the platform's device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Sequence

import torch

from duplex.kernels import cpu_attention, cpu_decode, cpu_fused, memory

DEFAULT_GPU_UTILIZATION = 0.9  # of the device's memory the engine may hold in all

# What kernels.ops dispatches to, per op, by where the tensors live. "c": the fused C
# kernels of kernels/cpu_*.c (built, switched on) where the shapes fit, else the torch
# reference; "torch" on CUDA: torch's own CUDA op (cuBLAS).
_CPU_BACKENDS = dict(attention="torch", store_kv="torch", rms_norm="torch", rotary="torch",
                     silu_and_mul="torch", matmul="torch", fused_moe="torch")
_CUDA_BACKENDS = dict(attention="triton", store_kv="triton", rms_norm="triton",
                      rotary="triton", silu_and_mul="triton", matmul="torch",
                      fused_moe="triton")


class PlatformError(ValueError):
    """A device string that cannot be honoured here."""


class NullStream:
    """A CUDA stream's interface on the CPU: work is already ordered, so nothing to do."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "NullEvent":
        return event if event is not None else NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class NullEvent:
    """A CUDA event's interface on the CPU: always complete."""

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class Platform:
    device: torch.device
    default_dtype: torch.dtype
    collective_backend: str  # torch.distributed backend for expert / tensor parallel groups

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    # ------------------------------------------------------------------ memory
    def kv_pool_bytes(self, configured_bytes: int,
                      utilization: float = DEFAULT_GPU_UTILIZATION) -> int:
        """Bytes the KV block pool may take. CPU: `configured_bytes` (a CPU figure, so it is
        not used on a GPU). CUDA: `utilization` of the device's memory less what is in use
        now; call it once the weights are on the device."""
        if not self.is_cuda:
            return configured_bytes
        assert 0.0 < utilization <= 1.0, f"utilization must be in (0, 1], got {utilization}"
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, int(total * utilization) - (total - free))

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed device buffer (the KV pool). On the CPU its pages are not touched until
        written (kernels.memory.zeros: resident memory grows with the blocks used) and are
        huge-page advised."""
        if not self.is_cuda:
            return memory.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def empty_host(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host staging buffer for copies to and from the device: pinned on CUDA."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    def ids_to_device(self, ids: Sequence[int]) -> torch.Tensor:
        """int64 indices on the device, copied from a pinned buffer without waiting (a plain
        `torch.tensor(ids, device=cuda)` copies from pageable memory and waits for every
        step queued before it). On the CPU: the host tensor."""
        values = torch.as_tensor(ids, dtype=torch.long)
        if not self.is_cuda:
            return values
        host = self.empty_host(values.shape, torch.long)
        return self.to_device(host.copy_(values))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of device tensor `t`: through a pinned buffer on the side copy stream,
        after the work queued so far on the current stream, waiting for that copy alone (not
        for the whole device). On the CPU: `t` itself, no copy."""
        if not self.is_cuda:
            return t
        host = self.empty_host(t.shape, t.dtype)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the allocator must not reuse t before the copy ran
        stream.synchronize()
        return host

    @functools.cached_property
    def _copy_stream(self):
        return self.copy_stream()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on this device; the same tensor (no copy) when it is already there. A host
        tensor in pinned memory copies asynchronously."""
        if t.device == self.device:
            return t
        return t.to(self.device, non_blocking=t.is_pinned())

    # ------------------------------------------------------------------ streams
    def copy_stream(self):
        """A side stream for KV copies (a NullStream on the CPU)."""
        return torch.cuda.Stream(self.device) if self.is_cuda else NullStream()

    def event(self):
        """An event to order work across streams (a NullEvent on the CPU)."""
        return torch.cuda.Event() if self.is_cuda else NullEvent()

    def stream(self, stream):
        """Context manager: work issued inside runs on `stream` (nothing on the CPU)."""
        if self.is_cuda:
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ kernels
    @property
    def kernel_backends(self) -> dict[str, str]:
        """op -> "triton" | "torch" | "c": what kernels.ops runs for tensors on this device
        (batch-invariant mode aside: kernels.batch_invariant on CPU, the triton matmul on
        CUDA)."""
        if self.is_cuda:
            return dict(_CUDA_BACKENDS)
        backends = dict(_CPU_BACKENDS)
        if cpu_fused.is_enabled():
            backends.update(rms_norm="c", rotary="c", silu_and_mul="c")
            if cpu_attention.available():
                backends["attention"] = "c"
            if cpu_decode.available():
                backends["decode_step"] = "c"
        return backends


class HostCopy:
    """A copy of a device tensor to the host, started and not waited for: a pinned buffer
    filled on the current stream after the work queued on it so far (a step's draws), an
    event after it. `wait` returns the host tensor once the copy is done, waiting for that
    copy and what came before it, not for work queued later (the next step). A CPU tensor
    is its own copy, done at once."""

    def __init__(self, t: torch.Tensor) -> None:
        if not t.is_cuda:
            self._host, self._event = t, NullEvent()
            return
        self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> torch.Tensor:
        self._event.synchronize()
        return self._host

    def is_done(self) -> bool:
        """Whether the copy has run (never waits)."""
        return self._event.query()


def resolve(spec: str = "auto") -> Platform:
    """The platform of a device string `auto | cpu | cuda | cuda:N`."""
    spec = spec.strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return cpu()
    if spec != "cuda" and not spec.startswith("cuda:"):
        raise PlatformError(f"device {spec!r}: expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise PlatformError(f"device {spec!r} asked for, but torch sees no CUDA device "
                            "(torch.cuda.is_available() is False); use --device cpu")
    device = torch.device(spec)
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise PlatformError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA "
                            "device(s) visible")
    return Platform(torch.device("cuda", index), torch.bfloat16, "nccl")


@functools.cache
def cpu() -> Platform:
    """The CPU platform (every component's default)."""
    return Platform(torch.device("cpu"), torch.float32, "gloo")


def place(obj: Any, platform: Platform) -> Any:
    """Move every tensor reachable from a loaded model (attributes, lists, tuples, named
    tuples, dicts) onto the platform's device, in place where the container is mutable;
    returns `obj`. Objects are visited once; on the CPU platform nothing is copied."""
    return _place(obj, platform, {})


def _place(obj: Any, platform: Platform, seen: dict[int, Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return platform.to_device(obj)
    if id(obj) in seen:
        return seen[id(obj)]
    if isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
        return obj
    seen[id(obj)] = obj
    if isinstance(obj, list):
        obj[:] = [_place(x, platform, seen) for x in obj]
    elif isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = _place(value, platform, seen)
    elif isinstance(obj, tuple):
        items = [_place(x, platform, seen) for x in obj]
        seen[id(obj)] = obj = type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and _is_ours(obj):
        for name, value in vars(obj).items():
            placed = _place(value, platform, seen)
            if placed is not value:
                object.__setattr__(obj, name, placed)  # frozen dataclasses too
    return obj


def _is_ours(obj: Any) -> bool:
    """Only the engine's and kernels' own objects are walked (not torch or numpy internals)."""
    return type(obj).__module__.startswith(("duplex.engine.", "duplex.kernels."))
