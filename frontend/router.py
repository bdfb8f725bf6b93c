"""Router: which worker computes a request's prompt, which one decodes it, and when it is sent.

Owns the prefill queues and the frontend's picture of each worker (its Ready, load, and the
block keys it probably holds). Only `frontend.dispatcher` calls it: it feeds the router
events and sends what it releases.

* Length buckets. A request's bucket is its prompt length after the expected cache hit
  (`bounds` 512, 4096 -> <=512, <=4096, >4096). Each bucket has its own FIFO and its own limit
  of outstanding prefills per worker (a prefill is outstanding until its first token), and
  the buckets are drained in turn, one request each per round. So a short prompt never
  queues behind long ones here, and a worker never holds a backlog of long prompts that its
  own FIFO would put ahead of a short one (inside a worker, `step_policy.shortest_first` runs
  a short prompt before the rest of a running long one).
* Prefix affinity. The keys of the prompt's full blocks (kvstore.keys, in the namespace the
  workers use: model identity, KV dtype, block size, layout and tenant salt from Ready) are
  matched against the keys last sent to each worker (an LRU as large as its block pool).
  The prompt goes to the worker that would finish it first: outstanding prompt tokens plus
  the tokens it would compute after its hit.
* Fleet-shared tier. Workers that announce the same shared store (`Ready.kv_shared`) read
  each other's published blocks from it, so the router keeps one more picture per store:
  the keys sent to any of its workers (an LRU of `SHARED_KEYS`). A worker's expected hit is
  then its own hit, or the store's where that is longer, with a block loaded from the store
  counted at `SHARED_LOAD_COST` of computing it. On a miss in every worker's picture the
  prompt still goes to the worker that would finish it first, because any worker is as
  warm as the store; a worker that joined late is warm for what the store holds.
* Decode. The live decode worker with the fewest streams (the frontend's own count plus the
  requests its latest heartbeat reports waiting).
* Health. Only workers the client reports alive are chosen; a restarted worker starts with an
  empty cache picture.

Roles: prompts go to prefill workers, else unified ones, else decode ones; a request gets a
decode worker only when its prompt goes to a prefill worker and a decode worker is alive.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from typing import NamedTuple

from duplex.engine.messages import AddRequest, Ready, WorkerStats
from duplex.kvstore import keys as kvkeys

DEFAULT_BUCKETS = (512, 4096)
# Outstanding prefills a worker may hold per bucket, shortest bucket first (the last value
# repeats for any further buckets).
DEFAULT_BUCKET_LIMITS = (16, 2, 1)
_PROMPT_ROLES = ("prefill", "unified", "decode")
SHARED_KEYS = 1 << 20  # block keys remembered per shared store (~16 MiB of picture)
# Time to load a block from the shared store relative to computing it (a 16-token block of
# a 135M model: ~0.7 MB over the network vs ~4 GFLOP); only the ordering of workers uses it.
SHARED_LOAD_COST = 0.1


class Route(NamedTuple):
    worker_id: str  # computes the prompt (and decodes too when decode_id is None)
    decode_id: str | None  # continues after the first token
    num_cached_tokens: int  # the hit the router expects on worker_id


class _Queued(NamedTuple):
    msg: AddRequest
    keys: list[bytes]


class _KeyPicture:
    """Block keys probably held somewhere, least recently sent first, bounded."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def num_hit_blocks(self, keys: list[bytes]) -> int:
        return sum(1 for _ in itertools.takewhile(self.keys.__contains__, keys))

    def remember(self, keys: list[bytes]) -> None:
        for key in keys:
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


class _Hit(NamedTuple):
    """What a worker is expected to have of a prompt, in tokens."""
    local: int  # in its device pool / host RAM (the router's picture of it)
    shared: int  # further tokens its shared store holds

    @property
    def num_tokens(self) -> int:
        return self.local + self.shared

    @property
    def saved(self) -> float:
        """Prompt tokens of compute this hit saves, net of loading from the store."""
        return self.local + self.shared * (1.0 - SHARED_LOAD_COST)


class _Worker:
    def __init__(self, ready: Ready) -> None:
        self.ready = ready
        self.picture = _KeyPicture(ready.num_kv_blocks)  # keys last sent to it
        self.outstanding: dict[str, tuple[int, int]] = {}  # req_id -> (bucket, tokens)
        self.decoding: set[str] = set()
        self.stats: WorkerStats | None = None
        self._namespaces: dict[str, bytes] = {}

    def namespace(self, cache_salt: str) -> bytes:
        """The worker's key namespace for a tenant (kvstore.keys.salt_from_wire, as in
        EngineCore._namespace)."""
        ns = self._namespaces.get(cache_salt)
        if ns is None:
            r = self.ready
            ns = self._namespaces[cache_salt] = kvkeys.namespace(
                r.model_identity, r.kv_dtype, r.block_size, r.kv_layout,
                kvkeys.salt_from_wire(cache_salt))
        return ns

    def num_hit_blocks(self, keys: list[bytes]) -> int:
        return self.picture.num_hit_blocks(keys)

    def remember(self, keys: list[bytes]) -> None:
        self.picture.remember(keys)

    def num_in_bucket(self, bucket: int) -> int:
        return sum(1 for b, _ in self.outstanding.values() if b == bucket)

    @property
    def outstanding_tokens(self) -> int:
        return sum(tokens for _, tokens in self.outstanding.values())

    @property
    def decode_load(self) -> int:
        waiting = self.stats.num_waiting if self.stats is not None else 0
        return len(self.decoding) + waiting


class Router:
    def __init__(self, bounds: tuple[int, ...] = DEFAULT_BUCKETS,
                 limits: tuple[int, ...] = DEFAULT_BUCKET_LIMITS) -> None:
        if list(bounds) != sorted(set(bounds)) or any(b <= 0 for b in bounds):
            raise ValueError(f"length buckets must be increasing positive bounds, got {bounds}")
        self.bounds = tuple(bounds)
        self.limits = tuple(limits[min(i, len(limits) - 1)] for i in range(len(bounds) + 1))
        self._queues: list[deque[_Queued]] = [deque() for _ in range(len(bounds) + 1)]
        self._workers: dict[str, _Worker] = {}
        self._shared: dict[str, _KeyPicture] = {}  # Ready.kv_shared -> keys in that store
        self._next_bucket = 0  # where the next draining round starts

    # ------------------------------------------------------------------ workers
    def add_worker(self, ready: Ready) -> None:
        """A worker (re)announced itself; a new process starts with an empty cache picture."""
        old = self._workers.get(ready.worker_id)
        if old is None or old.ready.pid != ready.pid:
            self._workers[ready.worker_id] = _Worker(ready)
        if ready.kv_shared and ready.kv_shared not in self._shared:
            self._shared[ready.kv_shared] = _KeyPicture(SHARED_KEYS)

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def update_stats(self, worker_id: str, stats: WorkerStats) -> None:
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.stats = stats

    # ------------------------------------------------------------------ queues
    def enqueue(self, msg: AddRequest) -> None:
        keys = self._keys(msg)
        best_hit = max((self._hit(w, keys).num_tokens for w in self._prompt_workers()),
                       default=0)
        self._queues[self.bucket_of(len(msg.prompt_token_ids) - best_hit)].append(
            _Queued(msg, keys))

    def bucket_of(self, num_tokens: int) -> int:
        return next((i for i, bound in enumerate(self.bounds) if num_tokens <= bound),
                    len(self.bounds))

    def remove(self, req_id: str) -> bool:
        """Drop a queued request (its client left); False if it was not queued."""
        for queue in self._queues:
            for item in queue:
                if item.msg.req_id == req_id:
                    queue.remove(item)
                    return True
        return False

    def pop_ready(self) -> list[tuple[AddRequest, Route]]:
        """Requests that may be sent now, with their routes: the buckets take turns, one
        request each per round, while a worker has room in that bucket."""
        released = []
        num_buckets = len(self._queues)
        while True:
            progressed = False
            for i in range(num_buckets):
                bucket = (self._next_bucket + i) % num_buckets
                routed = self._dispatch_head(bucket)
                if routed is not None:
                    released.append(routed)
                    progressed = True
            self._next_bucket = (self._next_bucket + 1) % num_buckets
            if not progressed:
                return released

    def _dispatch_head(self, bucket: int) -> tuple[AddRequest, Route] | None:
        queue = self._queues[bucket]
        if not queue:
            return None
        msg, keys = queue[0]
        candidates = [w for w in self._prompt_workers()
                      if w.num_in_bucket(bucket) < self.limits[bucket]]
        if not candidates:
            return None
        queue.popleft()
        num_tokens = len(msg.prompt_token_ids)
        worker = min(candidates, key=lambda w: w.outstanding_tokens + num_tokens
                     - self._hit(w, keys).saved)
        num_cached = self._hit(worker, keys).num_tokens
        worker.outstanding[msg.req_id] = (bucket, num_tokens - num_cached)
        worker.remember(keys)
        if worker.ready.kv_shared:
            self._shared[worker.ready.kv_shared].remember(keys)
        decode_id = self.pick_decode() if worker.ready.role == "prefill" else None
        if decode_id is not None:
            self._workers[decode_id].decoding.add(msg.req_id)
        return msg, Route(worker.ready.worker_id, decode_id, num_cached)

    # ------------------------------------------------------------------ progress
    def prefill_done(self, worker_id: str, req_id: str) -> None:
        """The prompt is computed (first token), or the request left that worker."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.outstanding.pop(req_id, None)

    def decode_moved(self, req_id: str, old_id: str | None, new_id: str | None) -> None:
        """The request decodes on new_id now (None: nowhere, it ended)."""
        for worker_id, add in ((old_id, False), (new_id, True)):
            worker = self._workers.get(worker_id) if worker_id else None
            if worker is not None:
                (worker.decoding.add if add else worker.decoding.discard)(req_id)

    def pick_decode(self, exclude: tuple[str, ...] = ()) -> str | None:
        decoders = [w for w in self._workers.values()
                    if w.ready.role == "decode" and w.ready.worker_id not in exclude
                    and w.ready.kv_address]
        if not decoders:
            return None
        return min(decoders, key=lambda w: w.decode_load).ready.worker_id

    def pick_resume(self, exclude: tuple[str, ...] = ()) -> str | None:
        """Where to recompute a stream: a decode worker, else any live worker."""
        decode_id = self.pick_decode(exclude)
        if decode_id is not None:
            return decode_id
        others = [w for w in self._workers.values() if w.ready.worker_id not in exclude]
        if not others:
            return None
        return min(others, key=lambda w: w.decode_load + len(w.outstanding)).ready.worker_id

    # ------------------------------------------------------------------ helpers
    def _hit(self, worker: _Worker, keys: list[bytes]) -> _Hit:
        block_size = worker.ready.block_size
        local = worker.num_hit_blocks(keys)
        store = self._shared.get(worker.ready.kv_shared) if worker.ready.kv_shared else None
        shared = store.num_hit_blocks(keys) if store is not None else 0
        return _Hit(local * block_size, max(0, shared - local) * block_size)

    def _prompt_workers(self) -> list[_Worker]:
        for role in _PROMPT_ROLES:
            workers = [w for w in self._workers.values() if w.ready.role == role]
            if workers:
                return workers
        return []

    def _keys(self, msg: AddRequest) -> list[bytes]:
        workers = self._prompt_workers()
        if not workers:
            return []
        worker = workers[0]
        return kvkeys.block_keys(worker.namespace(msg.cache_salt), msg.prompt_token_ids,
                                 worker.ready.block_size)


def parse_buckets(text: str) -> tuple[int, ...]:
    """`--length-buckets 512,4096` -> (512, 4096); "" or "none" -> () (one FIFO)."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        bounds = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--length-buckets takes comma-separated token counts, got {text!r}")
    if list(bounds) != sorted(set(bounds)) or bounds[0] <= 0:
        raise ValueError(f"--length-buckets must be increasing positive numbers, got {text!r}")
    return bounds
