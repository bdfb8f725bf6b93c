"""Command-line flags for EngineConfig (one flat flag per field of its sections), shared by
`duplex serve`, `duplex worker` and `duplex generate`, so every entry point spells the
engine's options the same way."""
from __future__ import annotations

import argparse
import dataclasses

from duplex.engine.config import (HANDOFF_LEASE_S, KV_CACHE_DTYPES, OVERLAP_MODES, WEIGHT_DTYPES,
                                  EngineConfig, WorkerConfig, section_of)

_HELP = {
    "model": "local GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)",
    "max_model_len": "context length limit (default: the model's own)",
    "block_size": "tokens per KV block",
    "kv_cache_bytes": "size of the device KV block pool in bytes",
    "kv_cache_dtype": "KV cache element type: auto (bfloat16 beside a GGUF file's quantized "
                      "weights on the CPU, where decode attention then reads half the bytes; "
                      "else the activations' dtype, so float32 stays exact), float32, "
                      "bfloat16, or int8 (each token's row per kv head as int8 values plus "
                      "one fp32 scale: ~1.9x the context of bfloat16 per byte of pool, host "
                      "and disk tier; not for DeepSeek's MLA cache)",
    "num_kv_blocks": "number of KV blocks (overrides --kv-cache-bytes)",
    "max_num_seqs": "most requests running in one step",
    "max_num_batched_tokens": "token budget of one step (0: auto, 256 on the CPU, where the "
                              "kernels run at full rate by then and a smaller step stalls "
                              "running streams less; 512 on a GPU)",
    "enable_prefix_caching": "reuse KV blocks of identical prefixes",
    "weights_dtype": "weight precision: auto (a GGUF file's 4/8-bit weights stay quantized), "
                     "float32 (exact), bfloat16, int8 or int4 (every linear weight)",
    "num_threads": "torch CPU threads per worker (0: the cores the worker may use, split "
                   "between the workers of one host)",
    "seed": "engine seed for requests without their own seed",
    "speculation": "speculative decoding: off, ngram, draft or self",
    "num_draft_tokens": "draft tokens proposed per step",
    "draft_model": "draft model path for --speculation draft",
    "spec_confidence": "choose draft lengths with the confidence head (else fixed length)",
    "spec_draft_layers": "target layers the self-draft runs (0: a quarter of them)",
    "spec_token_cost": "verify cost per token relative to a step (0: measure the cost curve)",
    "batch_invariant": "bitwise identical results whatever the batch (slower)",
    "device": "where weights, KV and steps run: auto (CUDA when torch sees a GPU, else the "
              "CPU), cpu, cuda or cuda:N",
    "gpu_memory_utilization": "CUDA: fraction of the device's memory that weights and the KV "
                              "pool may take (the pool gets what the weights leave)",
    "cuda_graphs": "CUDA: replay decode steps from CUDA graphs captured per batch size "
                   "(steps with a prompt token, drafts or a context over 8,192 run eagerly)",
    "overlap": "schedule and launch each step before the previous step's tokens are read "
               "(auto: on a GPU; on: also on the CPU; off). Outputs are the same; a request "
               "that stops on EOS or a stop token computes one wasted token",
    "kv_dir": "directory of the SSD KV tier (off when unset)",
    "kv_host_bytes": "host-RAM KV tier capacity in bytes (0: off)",
    "kv_disk_bytes": "SSD KV tier capacity in bytes",
    "kv_remote": "fleet-shared KV tier: redis://HOST:PORT/DB (or valkey://; a cluster: "
                 "redis+cluster://HOST:PORT), or a directory on a shared filesystem (off "
                 "when unset)",
    "kv_remote_bytes": "size budget of a shared-directory KV tier in bytes",
    "chat_ttl_s": "retention of chat KV blocks in seconds (default 7 days)",
    "agent_ttl_s": "retention of agent KV blocks in seconds (default 3 days)",
    "step_budget_ms": "time budget of one scheduler step in ms (0: token budget only)",
    "hybrid_kv": "sliding-window layers keep only their window of KV (models with SWA layers)",
    "expert_parallel": "processes the experts of a MoE model are sharded over (EP ranks)",
    "ep_redundant_experts": "spare expert slots per MoE layer for replicas of hot experts",
    "eplb_interval_steps": "engine steps between expert rebalances (EPLB)",
    "ep_master": "HOST:PORT of the EP rendezvous (default: MASTER_ADDR and MASTER_PORT, "
                 "else a free local port)",
    "ep_local_ranks": "EP ranks started on this host (0: all; the others join with "
                      "`duplex worker --ep-rank R`)",
}


_ALIASES = {"weights_dtype": ("--dtype",)}  # vLLM's spelling
# set by the served-worker flags below (add_worker_policy_arguments: serve and worker alike),
# or per process (--role, --heartbeat-s, --kv-bind: engine/worker_cli.py), so no engine flag
_NOT_FLAGS = ("fair_prefill", *(f.name for f in dataclasses.fields(WorkerConfig)))
_CHOICES = {"weights_dtype": WEIGHT_DTYPES, "kv_cache_dtype": KV_CACHE_DTYPES,
            "overlap": OVERLAP_MODES}


_GROUPS = {"": "engine: model and precision", "scheduler": "engine: scheduler",
           "cache": "engine: KV cache and its tiers", "spec": "engine: speculative decoding",
           "ep": "engine: expert parallel"}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Every engine flag, in one help group per EngineConfig section."""
    groups = {section: parser.add_argument_group(title) for section, title in _GROUPS.items()}
    for field in _flag_fields():
        group = groups[section_of(field.name)]
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=_HELP[field.name])
            continue
        kind = _scalar_type(field.type)
        flags = [flag, *_ALIASES.get(field.name, ())]
        group.add_argument(*flags, dest=field.name, type=kind, default=default,
                           help=_HELP[field.name], metavar=field.name.upper(),
                           choices=_CHOICES.get(field.name))


def add_worker_policy_arguments(group, *, unset: bool = False) -> None:
    """The served workers' policy flags, declared once for `duplex serve` (which puts them in
    the config every worker receives) and `duplex worker` (`unset`: None when not given, so
    they change a --config-json only where given)."""
    group.add_argument("--fair-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="prompts run shortest remaining first (aged by their wait), after "
                            "a token for each running stream, so short prompts do not queue "
                            "behind long ones (default: on, except with --expert-parallel)")
    group.add_argument("--handoff-lease-s", type=float, metavar="S",
                       default=None if unset else HANDOFF_LEASE_S,
                       help="longest a prefill worker holds blocks for a decode worker's "
                            "acknowledgement (prefill workers only"
                            + (f"; default: {HANDOFF_LEASE_S:g})" if unset else ")"))
    group.add_argument("--worker-key", default=None, metavar="FILE",
                       help="CURVE key (`duplex keys FILE`, or a shared-secret file) that "
                            "authenticates and encrypts the worker channel and KV doors; "
                            "required when a worker address is reachable from other hosts")


def worker_policy_from_args(args: argparse.Namespace, config: EngineConfig) -> dict:
    """The flat fields the policy flags set (those given, with `unset`); --fair-prefill left
    out is on, except in an expert-parallel group."""
    fair = args.fair_prefill if args.fair_prefill is not None else not config.ep.is_on
    policy = {"fair_prefill": fair, "worker_key": args.worker_key}
    if args.handoff_lease_s is not None:
        policy["handoff_lease_s"] = args.handoff_lease_s
    return policy


def engine_flags_given(args: argparse.Namespace) -> list[str]:
    """The engine flags whose value is not their default (what a --config-json would drop)."""
    return ["--" + f.name.replace("_", "-") for f in _flag_fields()
            if hasattr(args, f.name) and getattr(args, f.name) != f.default]


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The one EngineConfig of a command line: every engine flag into its section."""
    return EngineConfig.of(**{f.name: getattr(args, f.name) for f in _flag_fields()
                              if hasattr(args, f.name)})


def _flag_fields() -> list:
    return [f for f in EngineConfig.flat_fields() if f.name not in _NOT_FLAGS]


def _scalar_type(annotation: str) -> type:
    for name, kind in (("int", int), ("float", float), ("str", str)):
        if annotation.startswith(name):
            return kind
    raise TypeError(f"no CLI type for {annotation}")
