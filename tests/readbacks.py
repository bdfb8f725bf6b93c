"""`ReadBacks`: counts what makes the host wait for the device during a block of code.

Counted: `.item()`, `int()`, `float()`, `bool()`, `.tolist()` on a tensor (patched: a
tensor made under inference mode, as a step's are, dispatches `aten._local_scalar_dense`
past any dispatch mode); `_local_scalar_dense` itself for whatever else reaches it
(`torch.equal`, ...); and the ops whose output size depends on the data, which CUDA must
read back before it can allocate (`torch.bincount` reads the max, `nonzero`, boolean-mask
indexing, `masked_select`, `unique`, `repeat_interleave` by a tensor). On the CPU none of
these waits, so only this count shows what the device path would do on a GPU.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
SIZED_BY_DATA = frozenset({
    _aten._local_scalar_dense.default, _aten.bincount.default, _aten.nonzero.default,
    _aten.masked_select.default, _aten.repeat_interleave.Tensor,
    _aten.repeat_interleave.self_Tensor, _aten._unique2.default, _aten.unique_dim.default,
    _aten.unique_consecutive.default})
_INDEXING = frozenset({_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default})


class ReadBacks(TorchDispatchMode):
    READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.count = 0
        self.ops: list[str] = []  # what was counted, for the failure message
        self.reads: list[str] = []  # the values read by name (.item(), .tolist(), ...)
        self.monkeypatch = monkeypatch
        self.real = {name: getattr(torch.Tensor, name) for name in self.READS}

    def _counting(self, name, real):
        def read(t, *args, **kwargs):
            self._count(name)
            self.reads.append(name)
            with torch._C.DisableTorchFunctionSubclass():
                return real(t, *args, **kwargs)
        return read

    def _count(self, what: str) -> None:
        self.count += 1
        self.ops.append(what)

    def __enter__(self):
        for name, real in self.real.items():
            self.monkeypatch.setattr(torch.Tensor, name, self._counting(name, real))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self.real.items():
            self.monkeypatch.setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SIZED_BY_DATA:
            self._count(str(func))
        elif func in _INDEXING and _has_bool_index(args):
            self._count(f"{func} by a boolean mask")
        return func(*args, **(kwargs or {}))


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
