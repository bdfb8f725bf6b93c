"""`RedisBackend`: the shared KV tier on Redis or Valkey (`--kv-remote redis://HOST:PORT/DB`,
or a Redis / Valkey Cluster: `redis+cluster://HOST:PORT`, any one node as the seed).

Owns the connection to one Redis-protocol server and the key names in it:

    duplex:kv:<model namespace hex>:<block key hex>  ->  block file image (kvstore.blockfile)

The block key already chains from the tenant's namespace, and the value carries namespace,
key and CRC, so the name only routes; identity is checked on the bytes. Expiry is the
store's own: `SET NX PX <ms to the block's expires_at>` (7 d chat / 3 d agent by default),
and Redis evicts under `maxmemory` by its policy (volatile-lru / allkeys-lru recommended;
with noeviction a full store refuses writes, which are counted and dropped).

Why redis-py's asyncio client: the tiers already run an event loop on their own thread
(`engine.kv_tiers.KVTiers`), so the client lives there without a thread of its own, and a
read of a batch of a prefix is one pipelined round trip (GETs rather than one MGET, so a
cluster client can split the batch by hash slot). It retries once (a pooled connection gone stale after a store restart), no more: the `SharedTier`
bounds every call by a timeout and owns the decision to back off (its breaker).
"""
from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from duplex.kvstore import blockfile
from duplex.kvstore.blockfile import ReadResult, Status
from duplex.kvstore.entry import BlockEntry
from duplex.kvstore.keys import key_hex

SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://", "redis+cluster://",
           "rediss+cluster://", "valkey+cluster://", "valkeys+cluster://")


def is_redis_url(url: str) -> bool:
    return url.startswith(SCHEMES)


def plain_url(url: str) -> tuple[str, bool]:
    """(the URL as redis-py takes it, whether it names a cluster)."""
    scheme, _, rest = url.partition("://")
    is_cluster = scheme.endswith("+cluster")
    scheme = scheme.removesuffix("+cluster").replace("valkey", "redis", 1)
    return f"{scheme}://{rest}", is_cluster


class RedisBackend:
    kind = "redis"

    def __init__(self, url: str, namespace: bytes, op_timeout_s: float = 0.5) -> None:
        self.url, self.is_cluster = plain_url(url)
        self.namespace = namespace
        self.op_timeout_s = op_timeout_s
        self._prefix = f"duplex:kv:{key_hex(namespace)}:".encode()
        self._client: aioredis.Redis | RedisCluster | None = None
        self._store_bytes = 0

    def name(self, key: bytes) -> bytes:
        """The Redis key that stores block `key`."""
        return self._prefix + key_hex(key).encode()

    async def start(self) -> None:
        options = dict(socket_timeout=self.op_timeout_s,
                       socket_connect_timeout=self.op_timeout_s,
                       retry=Retry(NoBackoff(), 1))  # one retry: a stale pooled connection
        if self.is_cluster:  # its retries also follow MOVED / ASK redirections
            options["retry"] = Retry(NoBackoff(), 3)
            self._client = RedisCluster.from_url(self.url, **options)
            await self._client.initialize()
        else:
            self._client = aioredis.Redis.from_url(self.url, **options)
        await self._client.ping()

    async def ping(self) -> None:
        await self._require().ping()

    async def read(self, keys: Sequence[bytes]) -> list[ReadResult]:
        pipe = self._require().pipeline(transaction=False)
        for key in keys:
            pipe.get(self.name(key))
        values = await pipe.execute()
        results = [blockfile.decode_block(v, self.namespace, k) for k, v in zip(keys, values)]
        bad = [self.name(k) for k, r in zip(keys, results) if r.status is Status.CORRUPT]
        for name in bad:  # one by one: in a cluster they may live on different nodes
            await self._client.delete(name)
        return results

    async def write(self, items: list[tuple[bytes, BlockEntry]], now: float) -> int:
        pipe = self._require().pipeline(transaction=False)
        num_sent = 0
        for key, entry in items:
            ttl_ms = int((entry.expires_at - now) * 1000)
            if ttl_ms > 0:
                pipe.set(self.name(key), blockfile.encode_block(self.namespace, key, entry),
                         nx=True, px=ttl_ms)
                num_sent += 1
        if not num_sent:
            return 0
        replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
                raise reply
        return sum(isinstance(r, redis.exceptions.ResponseError) for r in replies)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def refresh(self) -> None:
        info = await self._require().info("memory")
        if self.is_cluster:  # {node: info} from every node
            self._store_bytes = sum(node.get("used_memory", 0) for node in info.values())
        else:
            self._store_bytes = info.get("used_memory", 0)

    def stats(self) -> dict[str, float]:
        """store_bytes: the server's used_memory (every key, not only Duplex's)."""
        return {"store_bytes": float(self._store_bytes)}

    def _require(self) -> aioredis.Redis | RedisCluster:
        if self._client is None:
            raise redis.exceptions.ConnectionError("not connected")
        return self._client
