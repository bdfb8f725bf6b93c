"""Fixtures for the kvstore tests: a settable clock and started disk tiers."""
from __future__ import annotations

import pytest

from duplex.kvstore.disk import DiskConfig, DiskTier
from kvstore_factories import NS, FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def disk_factory(tmp_path, clock):
    """Build started DiskTiers on tmp_path/kv (same root across calls: a restart)."""
    tiers = []

    async def build(capacity_bytes: int = 1 << 20, ns: bytes = NS, root=None,
                    **options) -> DiskTier:
        config = DiskConfig(str(root or tmp_path / "kv"), ns, capacity_bytes, **options)
        tier = DiskTier(config, clock=clock)
        await tier.start()
        tiers.append(tier)
        return tier

    yield build
    for tier in tiers:
        await tier.close()  # a no-op for tiers the test closed itself
