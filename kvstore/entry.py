"""`BlockEntry`: the KV of one block as the tiers store it — opaque bytes plus a small header.

The engine flattens one block (all layers, K and V) into one contiguous payload; kvstore never
looks inside it. The fields are validated here so every tier (the disk header included) can
encode any entry it is given.
"""
from __future__ import annotations

import dataclasses

MAX_DTYPE_CHARS = 31
MAX_ENCODING_CHARS = 15
MAX_NDIM = 8


@dataclasses.dataclass(frozen=True, slots=True)
class BlockEntry:
    """One block's KV. After `put` the store owns `payload`: the caller must not mutate it.

    payload: bytes-like, C-contiguous; dtype: torch-style name ("float32", "bfloat16");
    shape: how the engine views the payload; num_tokens: tokens it covers;
    expires_at: absolute time (same clock as the tiers) from which it is never served;
    encoding: how the elements hold the values ("": they are the values; "int8+f32scale":
    each row is int8 values and an fp32 scale, duplex.kernels.kv_store), so that a reader
    never takes one encoding for another.
    """
    payload: bytes
    dtype: str
    shape: tuple[int, ...]
    num_tokens: int
    expires_at: float
    encoding: str = ""

    def __post_init__(self) -> None:
        if len(self.encoding) > MAX_ENCODING_CHARS or not self.encoding.isascii():
            raise ValueError(f"encoding must be 0..{MAX_ENCODING_CHARS} ASCII chars: "
                             f"{self.encoding!r}")
        if not self.dtype or len(self.dtype) > MAX_DTYPE_CHARS or not self.dtype.isascii():
            raise ValueError(f"dtype must be 1..{MAX_DTYPE_CHARS} ASCII chars: {self.dtype!r}")
        if len(self.shape) > MAX_NDIM or any(not 0 <= d < 2**63 for d in self.shape):
            raise ValueError(f"shape must have <= {MAX_NDIM} non-negative dims: {self.shape}")
        if not 0 <= self.num_tokens < 2**32:
            raise ValueError(f"num_tokens out of range: {self.num_tokens}")
        if self.expires_at != self.expires_at:
            raise ValueError("expires_at must not be NaN")
        if not memoryview(self.payload).c_contiguous:
            raise ValueError("payload must be C-contiguous")

    @property
    def nbytes(self) -> int:
        return memoryview(self.payload).nbytes

    def is_expired(self, now: float) -> bool:
        return now >= self.expires_at
