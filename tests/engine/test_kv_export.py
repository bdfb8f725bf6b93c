"""The prefill side's hand-off frames (engine.kv_transfer.export_blocks): one gather of the
blocks, each frame the block's BlockEntry payload bytes, in the order asked."""
import torch

from duplex.engine.kv_tiers import BlockCodec
from duplex.engine.kv_transfer import export_blocks


def test_exported_frames_are_the_blocks_tier_payloads():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 2, 10, 4, 2, 8, generator=gen).to(torch.bfloat16)
    codec = BlockCodec(kv)
    ids = [7, 0, 3, 3, 9]
    frames = export_blocks(kv, ids)
    assert len(frames) == len(ids)
    for frame, block_id in zip(frames, ids):
        assert bytes(frame) == codec.save(block_id, 0.0).payload.tobytes()
    assert export_blocks(kv, []) == []
