"""`python -m kestrel export SOURCE`: write an adapter, a merged model or a checked GGUF file.

    python -m kestrel export runs/my-run --format gguf --quant q4_k_m --out exports/my-run
    python -m kestrel export runs/my-run --format merged --out exports/my-run-merged
    python -m kestrel export ./models/llama --format gguf --quant q8_0 --out exports/llama

SOURCE is a training output folder (holding adapter/ or model/), a PEFT adapter folder, a model
folder, or `demo`. The command prints the files written and each check's result; it exits 0 when
the export passed, 1 when a check failed (its files removed), 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kestrel.export.quantize import QUANT_TYPES


def add_export_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `export` subcommand on `subparsers` (from `ArgumentParser.add_subparsers`)."""
    p = subparsers.add_parser("export", help="export an adapter, a merged model or a GGUF file (checked)")
    p.add_argument("source", help="a training output folder, an adapter folder, a model folder, or `demo`")
    p.add_argument("--format", required=True, choices=("adapter", "merged", "gguf"), help="what to write")
    p.add_argument("--quant", default=None,
                   help=f"gguf: one of {', '.join(QUANT_TYPES)} (default f16); "
                        "merged: auto, bf16, f16 or f32 (default auto = as stored)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write into (created if missing)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the comparison with the Hugging Face model (tokenizer and template are still checked)")
    p.add_argument("--device", default=None, help="where the Hugging Face reference runs (default: cuda if present)")
    p.set_defaults(handler=run_export)
    return p


class _ProgressLine:
    """One status line on a terminal, rewritten in place; plain lines when piped."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = ""
        self.decile = -1

    def __call__(self, fraction: float, message: str) -> None:
        line = f"[{fraction * 100:5.1f}%] {message}"
        if self.tty:
            print("\r" + line.ljust(len(self.last)), end="", file=sys.stderr, flush=True)
        elif int(fraction * 10) != self.decile:  # a line every 10% when piped to a log
            print(line, file=sys.stderr)
            self.decile = int(fraction * 10)
        self.last = line

    def close(self) -> None:
        if self.tty and self.last:
            print(file=sys.stderr)


def run_export(args: argparse.Namespace) -> int:
    """Run the export; print the files and checks. Returns the exit code."""
    from transformers.utils import logging as hf_logging

    from kestrel.export import ExportCheckError, export

    hf_logging.disable_progress_bar()  # the export's own progress line says what is loading
    progress = _ProgressLine()
    try:
        result = export(args.source, args.format, args.out, quant=args.quant, progress=progress,
                        check=not args.no_check, device=args.device)
    except ExportCheckError as exc:
        print(exc.result.summary(), file=sys.stderr)
        print("error: the export failed its check; its files were removed", file=sys.stderr)
        return 1
    finally:
        progress.close()
    print(result.summary())
    return 0
