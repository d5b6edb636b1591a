"""`python -m kestrel ...` (or `kestrel ...`): train, chat, export and jobs, headless.

    python -m kestrel train [--no-store] CONFIG.yaml [--key value ...]   # e.g. --max_steps 30 --lora.r 8
    python -m kestrel chat MODEL [--adapter DIR] [--prompt TEXT] [--max-new-tokens N] [--temperature T]
    python -m kestrel export SOURCE --format adapter|merged|gguf [--quant q4_k_m] --out DIR
    python -m kestrel jobs submit|list|show|logs|resume|cancel|export ...   # see kestrel/cli/jobs.py
    python -m kestrel convert FOLDER   # pickled .bin weights -> safetensors (the only form Kestrel loads)
"""

from __future__ import annotations

import argparse
import logging
import sys

from kestrel.errors import KestrelError, one_line


def run_train(args: argparse.Namespace) -> int:
    from kestrel.config import load_config
    from kestrel.training.metrics import ProgressBar

    config = load_config(args.config, args.overrides)
    if args.no_store:
        from kestrel.training.run import run

        result = run(config, [ProgressBar()])
    else:  # recorded in the job store: the studio lists it (kestrel.jobs.external)
        from kestrel.jobs.external import train_here

        result = train_here(config, [ProgressBar()])
    if result.status == "failed":
        print(f"error: {one_line(result.error)}", file=sys.stderr)
        return 1
    print(f"{result.status}: step {result.step}, output in {result.output_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kestrel", description="Kestrel's engine, headless.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="fine-tune a model as a YAML config says")
    train.add_argument("--no-store", action="store_true",
                       help="do not record the run in the job store (the studio will not list it)")
    train.add_argument("config", help="the YAML config (the same file the studio writes)")
    train.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value pairs; dotted keys reach nested ones")
    train.set_defaults(handler=run_train)
    sub.add_parser("jobs", help="background training and export jobs (python -m kestrel jobs --help)")
    for module, adder in (("kestrel.cli.chat", "add_chat_parser"), ("kestrel.cli.export", "add_export_parser"),
                          ("kestrel.cli.convert", "add_convert_parser")):
        getattr(__import__(module, fromlist=[adder]), adder)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("httpx", "datasets", "transformers", "peft"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["jobs"]:
        from kestrel.cli.jobs import main as jobs_main

        return jobs_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KestrelError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
