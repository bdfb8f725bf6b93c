"""engine/models/gguf_reader.py against the `gguf` package's own reader (the reference): the
same keys, values, value types, tensor names, shapes, types and bytes, on the default model
and on files of every block type the `gguf` package writes; broken files are one
ModelLoadError naming what is wrong; the tokenizer digest that keys the tokenizer cache."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from duplex.engine.config import default_model_path
from duplex.engine.models.args import ModelLoadError
from duplex.engine.models.gguf_reader import read_gguf
from tests.models_gguf.conftest import write_gguf

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]  # gguf quantizes these
RAW_TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "Q8_1"]  # written as random blocks


def assert_same_as_gguf(path: str) -> None:
    mine, ref = read_gguf(path), gguf.GGUFReader(path)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(mine.fields) == list(ref_fields)
    for key, field in ref_fields.items():
        assert mine.types[key] == tuple(field.types), key
        value = field.contents()
        if isinstance(value, float):  # gguf gives the float32 widened; so does struct
            assert np.float32(mine.fields[key]) == np.float32(value), key
        else:
            assert mine.fields[key] == value, key
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(mine.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_the_default_model_reads_as_gguf_reads_it():
    assert_same_as_gguf(default_model_path())


def test_every_block_type_reads_as_gguf_reads_it(tmp_path):
    rng = np.random.default_rng(0)
    # 256-wide rows: K-quant blocks; 3-row and 1-D tensors beside them
    tensors = {"a.weight": rng.standard_normal((3, 256)).astype(np.float32),
               "b.weight": rng.standard_normal((256,)).astype(np.float32)}
    meta = {"block_count": 1, "per_layer": [1, 0, 1], "name_list": ["x", "yz"], "eps": 1e-5}
    for qtype in QTYPES:
        path = tmp_path / f"{qtype}.gguf"
        write_gguf(path, "llama", meta, tensors, qtype=qtype)
        assert_same_as_gguf(str(path))
        assert read_gguf(str(path)).tensors[0].tensor_type.name == qtype


@pytest.mark.parametrize("qtype", RAW_TYPES)
def test_blocks_gguf_cannot_write_read_as_gguf_reads_them(tmp_path, qtype):
    kind = gguf.GGMLQuantizationType[qtype]
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(1).integers(0, 256, (3, 512 // block * type_size), dtype=np.uint8)
    path = tmp_path / f"{qtype}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("a.weight", raw, raw_dtype=kind)
    writer.add_tensor("b.weight", np.ones(7, dtype=np.float32))  # after it: offsets add up
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf(str(path))
    first = read_gguf(str(path)).tensors[0]
    assert first.shape == (512, 3) and np.array_equal(first.data, raw)


def _minimal(tmp_path, body: bytes = b"", version: int = 3) -> str:
    path = tmp_path / "f.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, 0) + body)
    return str(path)


@pytest.mark.parametrize("content, reason", [
    (b"", "not a readable GGUF file (cannot mmap an empty file)"),
    (b"GGUF\x03\x00", "not a readable GGUF file (it ends at byte 6, inside the header)"),
    (b"GGML" + bytes(20), "not a readable GGUF file (the magic is b'GGML', not b'GGUF')"),
])
def test_a_file_that_is_no_gguf_is_one_error(tmp_path, content, reason):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as error:
        read_gguf(str(path))
    assert str(error.value) == f"{path}: {reason}"


def test_a_version_it_cannot_read_is_refused(tmp_path):
    path = _minimal(tmp_path, version=3 << 24)  # a big-endian file's version, read little-endian
    with pytest.raises(ModelLoadError, match=r"GGUF version 50331648 \(a big-endian file\?\)"):
        read_gguf(path)


def test_a_header_cut_inside_a_value_is_refused(tmp_path):
    key = b"general.name"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, 100) + b"short"
    path = tmp_path / "f.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    with pytest.raises(ModelLoadError, match="inside the value of general.name"):
        read_gguf(str(path))


def test_the_tokenizer_digest_follows_the_tokenizer_not_the_weights(tmp_path):
    """Two files with the default tokenizer and other weights share the digest (one cached
    conversion); another chat template or architecture gives another."""
    from tests.models_gguf.conftest import copy_tokenizer

    def write(name: str, arch: str, template: str | None, seed: int) -> str:
        writer = gguf.GGUFWriter(str(tmp_path / name), arch)
        copy_tokenizer(writer, default_model_path())
        if template is not None:
            writer.add_chat_template(template)
        writer.add_tensor("w", np.random.default_rng(seed).standard_normal(32).astype(np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return read_gguf(str(tmp_path / name)).tokenizer_digest

    same = write("a.gguf", "llama", None, 0)
    assert write("b.gguf", "llama", None, 1) == same
    assert write("c.gguf", "llama", "{{ messages }}", 0) != same
    assert write("d.gguf", "qwen2", None, 0) != same
