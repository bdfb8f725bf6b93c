"""`WorkerStats`: what a worker reports in every heartbeat, as typed msgspec structs.

One struct per owner of the figures (KV tiers, the fleet-shared tier, the cost model,
speculation, grammars, expert load, KV hand-off), each a field of `WorkerStats`; None where
the worker has no such part. Every struct knows how to merge the same struct of several
workers (`merge(items)`): counts and totals are summed, rates are kept as their numerator and
denominator (a property divides them), coefficients and calibration figures are means
weighted by the samples behind them, and a latency quantile merges as the largest one (an
upper bound: quantiles of different samples do not add). The frontend reads fields, never
key names; `engine.messages` re-exports `WorkerStats` with the other wire types.
"""
from __future__ import annotations

import itertools
from typing import ClassVar, Iterable, TypeVar

import msgspec

_WIRE = dict(frozen=True, array_like=True, omit_defaults=True, gc=False)
S = TypeVar("S", bound="Merged")


class Merged(msgspec.Struct, **_WIRE):
    """Base of every stats struct: each field is summed on merge (a list element by element,
    a nested struct by its own merge), except those named in WEIGHTED (a mean weighted by
    another field) and MAX (the largest value)."""
    WEIGHTED: ClassVar[dict[str, str]] = {}  # field -> field that weighs it
    MAX: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def merge(cls: type[S], items: Iterable[S | None]) -> S | None:
        """The figures of several workers as one; None if no item has any."""
        items = [item for item in items if item is not None]
        if not items:
            return None
        return cls(**{name: cls._merge_field(name, items) for name in cls.__struct_fields__})

    @classmethod
    def _merge_field(cls, name: str, items: list):
        values = [getattr(item, name) for item in items]
        if name in cls.MAX:
            return max(values)
        if name in cls.WEIGHTED:
            weights = [getattr(item, cls.WEIGHTED[name]) for item in items]
            return weighted_mean(values, weights)
        return _summed(values)

    def figures(self, prefix: str = "") -> dict[str, float]:
        """The struct's numbers by field name (lists and nested structs left out)."""
        return {prefix + name: float(getattr(self, name)) for name in self.__struct_fields__
                if isinstance(getattr(self, name), (int, float))}


def weighted_mean(values: list, weights: list[float]):
    """Mean of values (numbers, or equally long lists: element by element) weighted by
    weights; the plain mean where every weight is zero."""
    if isinstance(values[0], list):
        return [weighted_mean(list(column), weights) for column in zip(*values)]
    total = sum(weights)
    if not total:
        return sum(values) / len(values)
    return sum(v * w for v, w in zip(values, weights)) / total


def _summed(values: list):
    present = [v for v in values if v is not None]
    if not present:
        return None
    if isinstance(present[0], Merged):
        return type(present[0]).merge(present)
    if isinstance(present[0], list):
        return [sum(column) for column in itertools.zip_longest(*present, fillvalue=0.0)]
    return sum(present)


# ---------------------------------------------------------------- KV cache
class KVTierStats(Merged):
    """One tier of the prefix cache (device pool, host RAM, SSD, fleet-shared store)."""
    hit_tokens: float = 0.0  # prompt tokens it served
    hits: float = 0.0  # blocks found in it (host, disk, shared)
    bytes: float = 0.0  # held now (device, host, disk)
    entries: float = 0.0
    evictions: float = 0.0


class SharedTierStats(Merged):
    """The fleet-shared KV tier as one worker sees it (kvstore.shared.SharedTier.stats and
    its store's own figures). `store_bytes` is the one store's size, so it merges as a max."""
    on: float = 0.0  # 1 while the circuit breaker lets requests through
    hits: float = 0.0
    misses: float = 0.0
    puts: float = 0.0
    reads: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    dedup_skipped: float = 0.0
    write_dropped: float = 0.0
    write_errors: float = 0.0
    write_rejected: float = 0.0
    read_errors: float = 0.0
    corrupt_dropped: float = 0.0
    expired: float = 0.0
    breaker_trips: float = 0.0
    inflight_bytes: float = 0.0
    read_p50_ms: float = 0.0
    read_p99_ms: float = 0.0
    store_bytes: float = 0.0
    sweeps: float = 0.0  # a shared directory's sweeps (kvstore.shared_dir)
    swept_expired: float = 0.0
    swept_evicted: float = 0.0
    MAX: ClassVar[tuple[str, ...]] = ("on", "read_p50_ms", "read_p99_ms", "store_bytes")


class HybridKVStats(Merged):
    """Sliding-window models' hybrid KV (engine.hybrid_kv): bonded window replay."""
    bytes_stored: float = 0.0
    cached_tokens: float = 0.0  # tokens the stored bytes cover
    tokens_restored: float = 0.0
    tokens_replayed: float = 0.0
    tokens_prefilled: float = 0.0
    bonds: float = 0.0
    swa_blocks_used: float = 0.0

    @property
    def bytes_per_cached_token(self) -> float:
        return self.bytes_stored / self.cached_tokens if self.cached_tokens else 0.0


class KVStats(Merged):
    """The prefix cache: tokens looked up, each tier, the store's own counts."""
    queried_tokens: float = 0.0
    blocks_cached: float = 0.0  # device blocks addressable by their key
    device: KVTierStats = KVTierStats()
    host: KVTierStats = KVTierStats()
    disk: KVTierStats = KVTierStats()
    shared: KVTierStats = KVTierStats()
    misses: float = 0.0  # blocks found in no tier below the device
    spills: float = 0.0  # host evictions kept on disk
    expirations: float = 0.0
    corrupt_dropped: float = 0.0
    write_errors: float = 0.0
    shared_tier: SharedTierStats | None = None  # None: no --kv-remote
    hybrid: HybridKVStats | None = None  # None: not a hybrid-KV model

    @property
    def tiers(self) -> dict[str, KVTierStats]:
        return {"device": self.device, "host": self.host, "disk": self.disk,
                "shared": self.shared}

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served by any tier / prompt tokens looked up."""
        hits = sum(tier.hit_tokens for tier in self.tiers.values())
        return hits / self.queried_tokens if self.queried_tokens else 0.0


# ---------------------------------------------------------------- the step's cost model
class CostStats(Merged):
    """The fitted step-time model (engine.cost_model.NAMES: seconds per unit of each feature);
    merged as means weighted by the steps each worker measured."""
    prefill_token_s: float = 0.0
    attended_ktoken_s: float = 0.0
    decode_seq_s: float = 0.0
    step_s: float = 0.0
    median_rel_error: float = 0.0
    num_samples: float = 0.0
    WEIGHTED: ClassVar[dict[str, str]] = {
        name: "num_samples" for name in ("prefill_token_s", "attended_ktoken_s",
                                         "decode_seq_s", "step_s", "median_rel_error")}


# ---------------------------------------------------------------- speculation
class CalibrationBin(Merged):
    """One reliability bin of the confidence head: predictions in [low, low + 0.1)."""
    low: float = 0.0
    count: float = 0.0
    mean_predicted: float = 0.0
    observed: float = 0.0
    MAX: ClassVar[tuple[str, ...]] = ("low",)
    WEIGHTED: ClassVar[dict[str, str]] = {"mean_predicted": "count", "observed": "count"}


class HeadStats(Merged):
    """The confidence head's calibration (engine.spec.confidence.Calibration.report)."""
    num: float = 0.0  # predictions scored
    log_loss: float = 0.0
    brier: float = 0.0
    ece: float = 0.0
    bins: list[CalibrationBin] = []  # bins with samples
    WEIGHTED: ClassVar[dict[str, str]] = {"log_loss": "num", "brier": "num", "ece": "num"}

    @classmethod
    def _merge_field(cls, name: str, items: list):
        if name != "bins":
            return super()._merge_field(name, items)
        by_low: dict[float, list[CalibrationBin]] = {}
        for b in itertools.chain.from_iterable(item.bins for item in items):
            by_low.setdefault(b.low, []).append(b)
        return [CalibrationBin.merge(bins) for _, bins in sorted(by_low.items())]


class SpecStats(Merged):
    """Speculative decoding: drafts proposed and accepted, overall and by position."""
    num_draft_proposed: float = 0.0
    num_draft_accepted: float = 0.0
    num_rounds: float = 0.0  # verifications
    num_emitted: float = 0.0  # tokens those verifications appended
    proposed_by_position: list[float] = []
    accepted_by_position: list[float] = []
    head: HeadStats = HeadStats()
    step_cost_tokens: list[float] = []  # measured step cost (x one token's) at these sizes
    step_cost: list[float] = []
    MAX: ClassVar[tuple[str, ...]] = ("step_cost_tokens",)
    WEIGHTED: ClassVar[dict[str, str]] = {"step_cost": "num_rounds"}

    @property
    def acceptance_rate(self) -> float:
        proposed = self.num_draft_proposed
        return self.num_draft_accepted / proposed if proposed else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_emitted / self.num_rounds if self.num_rounds else 0.0


# ---------------------------------------------------------------- grammars
class GrammarStats(Merged):
    """Grammar-constrained decoding (engine.grammar)."""
    mask_seconds: float = 0.0
    masked_rows: float = 0.0
    waiting: float = 0.0  # requests waiting for their grammar
    cached: float = 0.0  # compiled grammars held
    compiles: float = 0.0
    compile_p50_s: float = 0.0
    compile_p99_s: float = 0.0
    MAX: ClassVar[tuple[str, ...]] = ("compile_p50_s", "compile_p99_s")


# ---------------------------------------------------------------- experts
class MoEStats(Merged):
    """Expert load of a mixture-of-experts model over the statistics window."""
    rank_tokens: list[float] = []  # (token, expert) pairs per EP rank, summed over layers
    imbalance_mean: float = 1.0  # max / mean rank load, mean over MoE layers
    imbalance_max: float = 1.0
    ep_ranks: float = 1.0
    rebalances: float = 0.0
    experts_received_rank0: float = 0.0
    MAX: ClassVar[tuple[str, ...]] = ("imbalance_mean", "imbalance_max", "ep_ranks")


# ---------------------------------------------------------------- KV hand-off
class HandoffStats(Merged):
    """A prefill worker's side of KV hand-off (engine.kv_transfer.KVSender)."""
    handoffs: float = 0.0
    acked: float = 0.0
    failed: float = 0.0
    blocks_sent: float = 0.0
    bytes_sent: float = 0.0
    blocks_pinned: float = 0.0  # held for hand-offs in flight


class IntakeStats(Merged):
    """A decode worker's side of KV hand-off (engine.kv_transfer.KVIntake)."""
    offers: float = 0.0
    blocks_received: float = 0.0
    continued: float = 0.0
    rejected_messages: float = 0.0
    rejected_kv_frames: float = 0.0  # malformed or hostile, at its KV door


# ---------------------------------------------------------------- the heartbeat's stats
class WorkerStats(Merged):
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    num_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_requests_added: int = 0
    num_requests_aborted: int = 0
    num_rejected_frames: int = 0  # malformed or hostile frames on the worker channel
    kv: KVStats | None = None
    cost: CostStats | None = None
    spec: SpecStats | None = None
    grammar: GrammarStats | None = None
    moe: MoEStats | None = None
    handoff: HandoffStats | None = None
    intake: IntakeStats | None = None
