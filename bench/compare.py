"""`duplex bench compare a.json b.json ...`: summaries side by side, with ratios to the first.

Takes run result files and sweep files (a sweep contributes one column per rate).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (label, path into the summary); ratios are other / first.
ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("completed", ("completed",)),
    ("failed", ("failed",)),
    ("rejected", ("rejected",)),
    ("cancelled", ("cancelled",)),
    ("duration (s)", ("duration_s",)),
    ("request throughput (req/s)", ("request_throughput",)),
    ("output throughput (tok/s)", ("output_throughput",)),
    ("total token throughput (tok/s)", ("total_token_throughput",)),
    ("goodput (req/s)", ("goodput",)),
    ("cache hit rate", ("cache_hit_rate",)),
    ("spec acceptance", ("spec_acceptance",)),
    *((f"{name} {stat} (ms)", (key, stat))
      for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                        ("e2e_ms", "e2e"))
      for stat in ("mean", "p50", "p90", "p99")),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", help="result JSON files (first = reference)")
    parser.add_argument("--out", default=None, help="also write the table to this .md file")


def run(args: argparse.Namespace) -> int:
    try:
        columns = [c for path in args.files for c in load_columns(Path(path))]
    except (OSError, ValueError, KeyError) as e:
        print(f"duplex bench compare: {e}", file=sys.stderr)
        return 2
    text = compare_markdown(columns)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


def load_columns(path: Path) -> list[tuple[str, dict]]:
    """(label, summary) pairs from a run result file or a sweep file."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if "points" in data:
        return [(p["label"], p["summary"]) for p in data["points"]]
    if "summary" not in data:
        raise ValueError(f"{path}: neither a run result nor a sweep file")
    return [(data.get("label") or path.stem, data["summary"])]


def compare_markdown(columns: list[tuple[str, dict]]) -> str:
    labels = [label for label, _ in columns]
    header = ["metric", *labels, *(f"{label} / {labels[0]}" for label in labels[1:])]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for name, keys in ROWS:
        values = [_lookup(summary, keys) for _, summary in columns]
        cells = [_fmt(v) for v in values] + [_ratio(v, values[0]) for v in values[1:]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _lookup(summary: dict, keys: tuple[str, ...]):
    value = summary
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _ratio(value, reference) -> str:
    if value is None or not reference:
        return "n/a"
    return f"{value / reference:.2f}x"
