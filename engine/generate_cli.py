"""`duplex generate`: offline generation from the command line, no server."""
from __future__ import annotations

import argparse
import sys

from duplex.engine.args import add_engine_arguments, engine_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text (repeat for several prompts)")
    parser.add_argument("--chat", action="store_true",
                        help="treat each prompt as one user message and apply the chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--gen-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from duplex.engine.llm import LLM
    from duplex.engine.models.loader import ModelLoadError
    from duplex.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.gen_seed,
                                stop=args.stop, ignore_eos=args.ignore_eos)
        llm = LLM(config=engine_config_from_args(args))
        if args.chat:
            system = [{"role": "system", "content": args.system}] if args.system else []
            outputs = llm.chat([system + [{"role": "user", "content": p}] for p in args.prompt],
                               params)
        else:
            outputs = llm.generate(args.prompt, params)
    except (ValueError, FileNotFoundError, ModelLoadError) as e:
        print(f"duplex generate: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outputs):
        if len(args.prompt) > 1:
            print(f"### {prompt}")
        print(out.text)
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]",
              file=sys.stderr)
    return 0
