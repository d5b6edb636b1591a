"""`python -m kestrel convert FOLDER`: pickled PyTorch weights -> safetensors, once, on purpose.

    python -m kestrel convert ./models/old-llama      # pytorch_model.bin -> model.safetensors
    python -m kestrel convert runs/old-run/adapter    # adapter_model.bin -> adapter_model.safetensors

Kestrel refuses to load pickled weights (`kestrel.model.safe_weights`); this is the one command
that reads them, with torch's restricted loader, for a file its user trusts.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_convert_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `convert` subcommand on `subparsers` (from `ArgumentParser.add_subparsers`)."""
    p = subparsers.add_parser("convert", help="convert a folder's pickled .bin weights to safetensors")
    p.add_argument("folder", help="the model or adapter folder holding pytorch_model*.bin or adapter_model.bin")
    p.set_defaults(handler=run_convert)
    return p


def run_convert(args: argparse.Namespace) -> int:
    from kestrel.model.safe_weights import convert

    for path in convert(args.folder):
        print(path)
    return 0
