"""The DUPLEX_* environment switches of the engine's code paths, read here and nowhere else.

Two kinds, neither a serve setting (a serve setting is a flag and a config field):

    developer    turn one kernel or fast path off, or retune it, to compare it with its
                 fallback (the defaults are the measured best; docs/BENCHMARKS.md)
    environment  where this machine keeps Duplex's own cache files, like HF_HOME: one
                 value per machine, shared by every command and the offline API

`duplex serve --print-config` lists each with its value and where it came from. A served worker
takes its server's values from its config (engine.config.WorkerConfig.switches, applied with
`apply` before the kernels load), not from its own environment. `kernels` imports nothing of
ours, so this table sits here and the engine and the tokenizer read it too.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class Switch:
    name: str  # the environment variable
    default: str  # "" where the default is worked out where it is read
    kind: str  # "developer" | "environment"
    help: str


SWITCHES = (
    Switch("DUPLEX_QGEMV", "1", "developer",
           "0: the int4 VNNI row kernel off (kernels/cpu_qgemv.py)"),
    Switch("DUPLEX_CPU_ATTENTION", "1", "developer",
           "0: the C decode attention off (kernels/cpu_attention.py)"),
    Switch("DUPLEX_CPU_PREFILL_ATTENTION", "1", "developer",
           "0: the C prompt attention off, torch's fused attention (kernels/cpu_attention.py)"),
    Switch("DUPLEX_FUSED_DECODE", "1", "developer",
           "0: the fused batch-1 decode layer off (kernels/cpu_decode.py)"),
    Switch("DUPLEX_GGUF_C", "1", "developer",
           "0: the C GGUF row kernels off, torch dequantizes (kernels/cpu_gguf.py)"),
    Switch("DUPLEX_ONEDNN_PACK", "1", "developer",
           "0: bf16 dense copies stay plain, not oneDNN-blocked (kernels/quant.py)"),
    Switch("DUPLEX_VNNI_ROWS", "", "developer",
           "most rows the VNNI kernel takes before a bf16 GEMM (empty: 64; 12 with AMX and dense copies)"),
    Switch("DUPLEX_INT8_PROMPT", "auto", "developer",
           "auto | 1 | 0: GGUF prompt steps take int8 activations, as decode steps (and "
           "llama.cpp's prompts) do. auto: K-quants on AVX-512 VNNI without AMX (1.35x the "
           "bf16 GEMM at 512 rows, 1.16x concurrency-16 output tokens/s at 1B); 1: block types "
           "on CPUs without AVX512-VNNI too; 0: the bf16 or fp32 tiles, a prompt's numbers "
           "fp32's up to their rounding (kernels/gguf_weight.py)"),
    Switch("DUPLEX_PROMPT_GEMM", "", "developer",
           "fp32 | bf16: the GEMM of GGUF prompt steps (empty: bf16 where the CPU has AMX-BF16 "
           "or AVX512-BF16, else fp32; kernels/gguf_weight.py)"),
    Switch("DUPLEX_GGUF_VNNI", "", "developer",
           "1 | 0: a GGUF file's Q4 weights get the VNNI kernel's layout too, or not (empty: "
           "files up to 256 MB; engine/models/gguf_quant.py)"),
    Switch("DUPLEX_GGUF_AMX", "1", "developer",
           "0: GGUF K-quant matmuls of 8+ rows take the AVX-512 VNNI loop, not AMX-INT8 tiles "
           "(kernels/cpu_gguf.c)"),
    Switch("DUPLEX_GGUF_VN16", "1", "developer",
           "0: GGUF K-quant matmuls of 8+ rows without AMX take the AVX-512 VNNI row loop, not "
           "the kernel with 16 weight rows in a register's lanes (kernels/cpu_gguf.c)"),
    Switch("DUPLEX_GGUF_XL16", "1", "developer",
           "0: GGUF K-quant matmuls of 5-8, 13-16 and 29-32 rows without AMX take the kernel "
           "with weight rows in a register's lanes (or the row loop), not the one with rows "
           "of x in the lanes (kernels/cpu_gguf.c)"),
    Switch("DUPLEX_GGUF_X8", "1", "developer",
           "0: on AVX2 without AVX-512 VNNI, GGUF K-quant matmuls of 6+ rows take the row loop "
           "and prompt steps the fp32 tiles, not the kernel with 8 rows of x in a register's "
           "lanes (kernels/cpu_gguf.c, x8_linear)"),
    Switch("DUPLEX_GGUF_KQ_PREFETCH", "1", "developer",
           "0: the AVX2 K-quant row kernel at one row of x does not prefetch its rows' next "
           "blocks (kernels/cpu_gguf.c, kq_rows)"),
    Switch("DUPLEX_GGUF_BF16_GEMM", "1", "developer",
           "0: GGUF prompt GEMMs on CPUs with AVX512-BF16 and no AMX take dequantized chunks "
           "and oneDNN's GEMM, not the C kernel on the file's blocks (kernels/cpu_gguf.c)"),
    Switch("DUPLEX_DENSE_WEIGHTS", "0", "developer",
           "1: every GGUF weight also keeps a bf16 copy, to measure what one costs "
           "(kernels/gguf_weight.py)"),
    Switch("DUPLEX_BF16_STREAM", "1", "developer",
           "0: layers pass fp32 between fused kernels (bitwise the same results; "
           "engine/models/llama.py)"),
    Switch("DUPLEX_TOKENIZER_CACHE", "1", "environment",
           "0: a GGUF file's converted tokenizer is not cached (engine/text/tokenizer.py)"),
    Switch("DUPLEX_CACHE_DIR", "", "environment",
           "root of Duplex's cache files (empty: ~/.cache/duplex)"),
)
_BY_NAME = {s.name: s for s in SWITCHES}
_applied: dict[str, str] = {}  # a served worker's values from its config


def value(name: str) -> str:
    """The switch's value: applied by a served worker's config, else the environment's, else
    its default."""
    if name in _applied:
        return _applied[name]
    return os.environ.get(name, _BY_NAME[name].default)


def is_off(name: str) -> bool:
    """Whether an on-by-default switch is turned off (set to 0)."""
    return value(name) == "0"


def source(name: str) -> str:
    if name in _applied:
        return "config"
    return "env" if name in os.environ else "default"


def current() -> tuple[tuple[str, str], ...]:
    """Every switch's value now, as the (name, value) pairs a worker's config carries."""
    return tuple((s.name, value(s.name)) for s in SWITCHES)


def apply(values: Iterable[tuple[str, str]]) -> None:
    """Take these values over the environment's (a served worker: its server's switches).
    Call it before the kernels load: some are read once, at import."""
    values = dict(values)
    unknown = sorted(set(values) - set(_BY_NAME))
    if unknown:
        raise ValueError(f"unknown switches: {', '.join(unknown)} (known: "
                         f"{', '.join(_BY_NAME)})")
    _applied.update(values)
