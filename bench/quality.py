"""`duplex bench quality`: what a weight precision costs in model quality, measured.

Each precision (a `--dtype` value, or `DTYPE:KV` for a `--kv-cache-dtype` other than its
auto, e.g. `auto:float32`) reads the same fixed text in one teacher-forced pass; the
figures are its perplexity on that text and its greedy top-1 agreement with float32 (the
exact mode: every weight dequantized; `--reference` picks another, e.g. `auto:bfloat16`
against `auto:int8` for what the int8 KV cache costs): the share of positions where both
pick the same next token given the same context. Every position's query reads the keys and
values back from the KV cache, so a KV precision is measured as decoding would see it.
Free-running greedy outputs are not compared: one near-tie flips the rest of a sequence,
which says little about the weights.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import NamedTuple

import torch

from duplex.engine.config import KV_CACHE_DTYPES, WEIGHT_DTYPES, EngineConfig

FIXED_TEXT = (
    "The river rises in the hills above the town and runs for forty miles before it reaches "
    "the sea. In spring the snow melts and the water climbs the stone walls of the old mill; "
    "in late summer it is shallow enough that children cross it on foot. The town grew up "
    "around the bridge, which was first built of wood, burned twice, and was rebuilt in stone "
    "in the year the railway came. Today most people who live there work in the valley's two "
    "factories, one of which makes paper and the other glass. The paper mill uses the river "
    "for power and for water, and its owners have spent a great deal of money keeping the "
    "water clean, because the fishermen downstream watch it closely.\n\n"
    "To compute the average of a list of numbers, add them together and divide the sum by "
    "how many there are. For example, the average of 2, 4 and 9 is 15 divided by 3, which is "
    "5. A median is different: sort the numbers and take the middle one, or the mean of the "
    "two middle ones when the list has an even length. The median is less sensitive to a "
    "single very large value, which is why reports of income usually give it instead of the "
    "mean.\n\n"
    "def count_words(text):\n"
    "    counts = {}\n"
    "    for word in text.lower().split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n"
    "    return sorted(counts.items(), key=lambda item: -item[1])\n\n"
    "Dear Anna, thank you for your letter. We arrived on Tuesday after a long journey; the "
    "train was late, and we missed the last bus, so we walked the final three miles under a "
    "clear sky full of stars. The house is smaller than I remembered, but the garden is "
    "wonderful, and the neighbours have already invited us to dinner on Saturday.")


class Quality(NamedTuple):
    dtype: str  # the precision as given: DTYPE or DTYPE:KV
    perplexity: float
    top1_agreement: float  # with the reference precision (float32), over the text's positions
    weight_bytes: int


def teacher_forced_logits(core, token_ids: list[int], prompt: bool = True) -> torch.Tensor:
    """fp32 logits `[L, vocab]` of every position of one sequence, in one forward pass: a
    prompt step, as the engine runs one (the kernels a prompt takes, kernels.quant), or with
    prompt=False a step of as many decode rows."""
    from duplex.engine.models import ForwardContext
    from duplex.kernels.quant import prompt_step

    n, bs = len(token_ids), core.block_size
    assert n <= core.num_kv_blocks * bs, "the text does not fit in the KV pool"
    positions = torch.arange(n)
    ctx = ForwardContext(
        positions=positions, slot_mapping=positions.clone(),
        block_tables=torch.arange(-(-n // bs), dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), kv_caches=core.runner.kv_caches,
        query_lens=[n], host_seq_lens=[n], block_size=bs, slots_valid=True)
    with torch.inference_mode(), prompt_step(prompt):
        hidden = core.model.forward(torch.tensor(token_ids), ctx)
        return core.model.compute_logits(hidden)


def weight_bytes(model) -> int:
    """Bytes of every weight the model holds (quantized ones as stored)."""
    seen, total = set(), 0
    for obj in _weights(model):
        if id(obj) not in seen:
            seen.add(id(obj))
            total += obj.nbytes if not isinstance(obj, torch.Tensor) else \
                obj.numel() * obj.element_size()
    return total


def _weights(obj, depth: int = 0):
    from duplex.kernels.quant import QuantEmbedding, QuantWeight

    for value in vars(obj).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, (torch.Tensor, QuantWeight, QuantEmbedding)):
                yield item
            elif hasattr(item, "__dict__") and depth < 3 and not isinstance(item, type):
                yield from _weights(item, depth + 1)


def measure(model: str | None, dtypes: list[str], text: str = FIXED_TEXT,
            num_threads: int = 0, reference: str = "float32",
            prompt: bool = True) -> list[Quality]:
    """Perplexity and top-1 agreement with `reference` (a precision, DTYPE or DTYPE:KV;
    float32 by default) of each precision on `text`, in a prompt step (or prompt=False:
    a decode step's kernels)."""
    from duplex.engine.core import EngineCore
    from duplex.engine.text.tokenizer import load_tokenizer

    expected, out = None, []  # the reference's top-1 tokens, from its run (the first)
    for dtype in [reference, *[d for d in dtypes if d != reference]]:
        weights, _, kv = dtype.partition(":")
        core = EngineCore(EngineConfig.of(model=model, weights_dtype=weights,
                                          kv_cache_dtype=kv or "auto", num_threads=num_threads,
                                          enable_prefix_caching=False), progress=False)
        if expected is None:
            ids = load_tokenizer(core.model_path).encode(text)
        logits = teacher_forced_logits(core, ids, prompt)
        top1 = logits[:-1].argmax(-1)
        expected = top1 if expected is None else expected
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
        out.append(Quality(dtype, math.exp(float(nll)),
                           float((top1 == expected).float().mean()), weight_bytes(core.model)))
    return [q for q in out if q.dtype in dtypes]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default model)")
    parser.add_argument("--dtypes", default="float32,auto,int8,int4,bfloat16",
                        help=f"comma-separated, from {', '.join(WEIGHT_DTYPES)}; DTYPE:KV sets "
                             f"the KV cache's dtype too (KV from {', '.join(KV_CACHE_DTYPES)})")
    parser.add_argument("--reference", default="float32",
                        help="the precision (DTYPE or DTYPE:KV) top-1 agreement is measured "
                             "against, e.g. auto:bfloat16 to see what an int8 KV cache costs "
                             "beside the bfloat16 one")
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument("--decode-path", action="store_true",
                        help="run every position through the small-batch kernels (int4 / "
                             "VNNI, GGUF rows on int8 activations) of a decode step instead "
                             "of those a prompt step takes")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = sorted(d for d in {*dtypes, args.reference}
                     if d.partition(":")[0] not in WEIGHT_DTYPES
                     or d.partition(":")[2] not in ("", *KV_CACHE_DTYPES))
    if unknown:
        print(f"duplex bench quality: unknown dtypes {unknown}", file=sys.stderr)
        return 2
    if args.decode_path:  # every row count takes the few-row kernels
        from duplex.kernels import gguf_weight, quant
        quant.MAX_PACKED_ROWS = quant.MAX_VNNI_ROWS = 10**9
        gguf_weight.GEMV_ROWS = gguf_weight.AMX_ROW_LIMIT = 10**9
    results = measure(args.model, dtypes, num_threads=args.num_threads,
                      reference=args.reference, prompt=not args.decode_path)
    if args.json:
        print(json.dumps([q._asdict() for q in results], indent=2))
        return 0
    print(f"| --dtype[:kv] | perplexity | top-1 agreement with {args.reference} | weights (MB) |")
    print("| --- | --- | --- | --- |")
    for q in results:
        print(f"| {q.dtype} | {q.perplexity:.3f} | {100 * q.top1_agreement:.1f} % | "
              f"{q.weight_bytes / 1e6:.0f} |")
    return 0
