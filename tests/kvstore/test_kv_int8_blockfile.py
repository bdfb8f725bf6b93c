"""Block file format 2 (kvstore/blockfile.py): the header records the KV encoding (an int8
pool's packed rows, "int8+f32scale"), which round-trips through every tier's file image;
a format 1 file, even an intact one, is refused and dropped, never read as format 2."""
from __future__ import annotations

import os
import struct
import zlib

import pytest

from duplex.kvstore import blockfile
from duplex.kvstore.blockfile import HEADER_BYTES, MAGIC, Status
from duplex.kvstore.entry import BlockEntry
from duplex.kvstore.keys import LAYOUT_VERSION
from kvstore_factories import NS, make_keys, payload_of

INT8 = "int8+f32scale"
K = make_keys(2)
FORMAT_1_FIELDS = struct.Struct("<8sHH16s16sdIQB31sB7x8Q")  # format 1's header, before the CRC


def _int8_entry(seed: int = 0) -> BlockEntry:
    return BlockEntry(payload_of(seed, 2 * 4 * 2 * 20), "int8", (2, 2, 4, 2, 20), 4, 2e9, INT8)


def _format_1_image(key: bytes, entry: BlockEntry) -> bytes:
    """The file format 1 wrote for `entry` (checksum intact)."""
    dims = tuple(entry.shape) + (0,) * (8 - len(entry.shape))
    head = FORMAT_1_FIELDS.pack(MAGIC, 1, LAYOUT_VERSION, NS, key, entry.expires_at,
                                entry.num_tokens, entry.nbytes, len(entry.dtype),
                                entry.dtype.encode(), len(entry.shape), *dims)
    head += bytes(HEADER_BYTES - 4 - len(head))
    payload = bytes(entry.payload)
    return head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + payload


def test_the_encoding_round_trips_and_is_part_of_the_entry():
    assert blockfile.FORMAT_VERSION == 2
    entry = _int8_entry()
    got = blockfile.decode_block(blockfile.encode_block(NS, K[0], entry), NS, K[0])
    assert got.status is Status.OK and got.entry == entry and got.entry.encoding == INT8
    plain = BlockEntry(entry.payload, "int8", entry.shape, 4, 2e9)  # "": plain elements
    assert blockfile.decode_block(blockfile.encode_block(NS, K[0], plain), NS, K[0]).entry != entry


def test_an_encoding_name_is_checked_like_the_dtype():
    with pytest.raises(ValueError, match="encoding"):
        BlockEntry(b"x", "int8", (1,), 1, 0.0, "e" * 16)
    image = bytearray(blockfile.encode_block(NS, K[0], _int8_entry()))
    image[168] = 16  # an encoding length past its field
    assert "encoding" in blockfile.decode_block(bytes(image), NS, K[0]).reason


async def test_a_format_1_file_is_refused_and_dropped(disk_factory):
    tier = await disk_factory()
    assert tier.put(K[1], _int8_entry(1))  # a format 2 neighbour stays readable
    await tier.flush()
    await tier.close()
    path = tier.path(K[0])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:  # left by the previous version
        f.write(_format_1_image(K[0], _int8_entry(0)))
    read = blockfile.read_block(path, NS, K[0], 0)
    assert read.status is Status.CORRUPT and read.reason == "format version 1 != 2"
    again = await disk_factory()
    assert await again.get(K[0]) is None
    await again.flush()
    assert again.stats()["corrupt_dropped"] == 1 and not os.path.exists(path)
    assert await again.get(K[1]) == _int8_entry(1)
