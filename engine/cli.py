"""`python -m engine ...`: train, chat and export from the command line, headless.

    python -m engine train CONFIG.yaml [--key value ...]   # e.g. --max_steps 30 --lora.r 8
    python -m engine chat MODEL [--adapter DIR] [--prompt TEXT] [--max-new-tokens N] [--temperature T]
    python -m engine export SOURCE --format adapter|merged|gguf [--quant q4_k_m] --out DIR
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.errors import KestrelError


def run_train(args: argparse.Namespace) -> int:
    from engine.config import load_config
    from engine.metrics import ProgressBar
    from engine.train import run

    config = load_config(args.config, args.overrides)
    result = run(config, [ProgressBar()])
    if result.status == "failed":
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    print(f"{result.status}: step {result.step}, output in {result.output_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="Kestrel's engine, headless.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="fine-tune a model as a YAML config says")
    train.add_argument("config", help="the YAML config (the same file the studio writes)")
    train.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value pairs; dotted keys reach nested ones")
    train.set_defaults(handler=run_train)
    for module, adder in (("engine.cli_chat", "add_chat_parser"), ("engine.cli_export", "add_export_parser")):
        getattr(__import__(module, fromlist=[adder]), adder)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("httpx", "datasets", "transformers", "peft"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # bitsandbytes probes an unrelated hub package that is also named `kernels`; its notice is noise.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KestrelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
