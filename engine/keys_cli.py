"""`duplex keys FILE`: write a new CURVE keypair for a deployment (see engine/curve.py).

Copy FILE to every host of the deployment (keep it 0600) and pass it as `--worker-key FILE` to
`duplex serve` and each `duplex worker`; only holders of FILE can join the worker channel or
a KV door. Without `duplex keys`, any file of at least 32 secret bytes works as well.
"""
from __future__ import annotations

import argparse
import sys

from duplex.engine import curve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="where to write the key (must not exist)")


def run(args: argparse.Namespace) -> int:
    try:
        curve.write_key_file(args.file, curve.generate())
    except OSError as e:
        print(f"duplex keys: {e}", file=sys.stderr)
        return 2
    print(f"wrote a CURVE key to {args.file}; pass --worker-key {args.file} to `duplex serve` "
          "and every `duplex worker`")
    return 0
