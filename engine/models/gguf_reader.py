"""Reading a GGUF file: its key/value metadata and a zero-copy view of each tensor.

`gguf.GGUFReader` builds one numpy view per value, so a file with a 50k-token vocabulary
(tokens and merges: ~100k strings) takes seconds to open, and Duplex opens a model file on
every start (the frontend's check, each worker's load). This reader walks the header once
with `struct`, decodes strings directly and maps the tensor data with one `np.memmap`: the
same values and the same tensor arrays as gguf's reader (`data` is typed for F32/F16/F64 and
the integer types, and bytes per row for every block type, as `gguf.dequantize` reads it), in
milliseconds. The format's constants (value types, block sizes) come from the `gguf` package.

Layout (little-endian): magic "GGUF", version u32, tensor count u64, key/value count u64; each
key/value: key string (u64 length, UTF-8), value type u32, value (an array: element type u32,
count u64, elements); each tensor: name, n_dims u32, dims u64 (fastest axis first), type u32,
offset u64; tensor data starts at the next multiple of `general.alignment` (default 32).
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from duplex.engine.models.args import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_SCALARS = {  # value type -> (struct format, size)
    GGUFValueType.UINT8: ("<B", 1), GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2), GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4), GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4), GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8), GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
_NUMPY = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
          GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
          GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
          GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}
# tensor types whose data is typed elements; every other type is bytes per row
_ELEMENT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


class GGUFTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # as stored: fastest axis first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # a read-only view of the file (row-major shape; bytes per row if blocked)


class GGUFFile(NamedTuple):
    path: str
    version: int
    fields: dict[str, Any]  # key -> str | int | float | bool | list (arrays)
    types: dict[str, tuple[GGUFValueType, ...]]  # key -> (type,) or (ARRAY, element type)
    tensors: list[GGUFTensor]
    tokenizer_digest: str  # sha256 of the architecture and every tokenizer.* entry's bytes


class _Truncated(Exception):
    pass


def read_gguf(path: str) -> GGUFFile:
    """The metadata and tensors of the GGUF file at `path`; a file that is not a complete,
    readable GGUF is a ModelLoadError naming the file and what is wrong."""
    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as error:  # missing, unreadable, or empty (mmap of 0 bytes)
        raise ModelLoadError(f"{path}: not a readable GGUF file ({error})") from None
    try:
        return _parse(path, buf)
    except _Truncated as error:
        raise ModelLoadError(f"{path}: not a readable GGUF file (it ends at byte {len(buf)}, "
                             f"inside {error})") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({error})") from None


class _Cursor:
    """Reads values in order from the file's bytes; running past the end is `_Truncated`."""

    def __init__(self, buf: np.ndarray) -> None:
        self.view, self.size, self.offset = memoryview(buf), len(buf), 0

    def unpack(self, fmt: str, what: str) -> tuple:
        width = struct.calcsize(fmt)
        self.need(width, what)
        out = struct.unpack_from(fmt, self.view, self.offset)
        self.offset += width
        return out

    def need(self, nbytes: int, what: str) -> None:
        if self.offset + nbytes > self.size:
            raise _Truncated(what)

    def string(self, what: str) -> str:
        (length,) = self.unpack("<Q", what)
        self.need(length, what)
        text = bytes(self.view[self.offset:self.offset + length]).decode("utf-8")
        self.offset += length
        return text

    def value_type(self, key: str) -> GGUFValueType:
        (raw,) = self.unpack("<I", f"the value of {key}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"key {key} has value type {raw}, which GGUF does not define") from None

    def field(self, key: str) -> tuple[Any, tuple[GGUFValueType, ...]]:
        """The value of `key` (read after its name) and its types."""
        what = f"the value of {key}"
        kind = self.value_type(key)
        if kind == GGUFValueType.STRING:
            return self.string(what), (kind,)
        if kind != GGUFValueType.ARRAY:
            return self.unpack(_SCALARS[kind][0], what)[0], (kind,)
        element = self.value_type(key)
        (count,) = self.unpack("<Q", what)
        if element == GGUFValueType.STRING:
            return [self.string(what) for _ in range(count)], (kind, element)
        if element not in _NUMPY:
            raise ValueError(f"key {key} is an array of {element.name}, which Duplex cannot read")
        width = np.dtype(_NUMPY[element]).itemsize
        self.need(count * width, what)
        values = np.frombuffer(self.view, _NUMPY[element], count, self.offset).tolist()
        self.offset += count * width
        return values, (kind, element)


def _parse(path: str, buf: np.ndarray) -> GGUFFile:
    cursor = _Cursor(buf)
    cursor.need(24, "the header")
    if bytes(cursor.view[:4]) != MAGIC:
        raise ValueError(f"the magic is {bytes(cursor.view[:4])!r}, not {MAGIC!r}")
    cursor.offset = 4
    version, num_tensors, num_kv = cursor.unpack("<IQQ", "the header")
    if version not in VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ValueError(f"GGUF version {version}{hint}; Duplex reads versions 2 and 3")
    fields, types, digest = {}, {}, hashlib.sha256()
    for _ in range(num_kv):
        start = cursor.offset
        key = cursor.string("a metadata key")
        fields[key], types[key] = cursor.field(key)
        if key.startswith("tokenizer."):
            digest.update(cursor.view[start:cursor.offset])
    digest.update(str(fields.get("general.architecture")).encode())
    infos = []
    for _ in range(num_tensors):
        name = cursor.string("the tensor table")
        (n_dims,) = cursor.unpack("<I", f"the entry of tensor {name}")
        dims = cursor.unpack(f"<{n_dims}Q", f"the entry of tensor {name}")
        raw_type, data_offset = cursor.unpack("<IQ", f"the entry of tensor {name}")
        infos.append((name, tuple(int(d) for d in dims), raw_type, data_offset))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.offset // alignment) * alignment
    tensors, seen = [], set()
    for name, dims, raw_type, data_offset in infos:
        if name in seen:
            raise ValueError(f"tensor {name} appears twice")
        seen.add(name)
        tensors.append(_tensor(buf, name, dims, raw_type, data_start + data_offset, cursor.size))
    return GGUFFile(path, version, fields, types, tensors, digest.hexdigest())


def _tensor(buf: np.ndarray, name: str, dims: tuple[int, ...], raw_type: int, start: int,
            size: int) -> GGUFTensor:
    try:
        kind = GGMLQuantizationType(raw_type)
    except ValueError:
        raise ValueError(f"tensor {name} has type {raw_type}, which GGUF does not define") from None
    shape = tuple(reversed(dims))  # row-major
    num_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    block, type_size = GGML_QUANT_SIZES[kind]
    if kind in _ELEMENT_TYPES:
        dtype, count = np.dtype(_ELEMENT_TYPES[kind]), num_elements
    else:
        if shape[-1] % block:
            raise ValueError(f"tensor {name} has rows of {shape[-1]} values, not a multiple of "
                             f"{kind.name}'s block of {block}")
        dtype, count = np.dtype(np.uint8), num_elements // block * type_size
        shape = (*shape[:-1], shape[-1] // block * type_size)
    nbytes = count * dtype.itemsize
    if start + nbytes > size:
        raise _Truncated(f"the data of tensor {name}")
    data = np.ndarray(shape, dtype=dtype, buffer=buf, offset=start)
    return GGUFTensor(name, dims, kind, data)
