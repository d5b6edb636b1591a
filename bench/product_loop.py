"""The product's own SFT loop (`kestrel.training.run.run`, as the studio and the CLI run it) with the host a
step ahead of the GPU (`sft.runs_ahead`, the default on CUDA) against step by step (each step read and
reported before the next is queued), on a matrix model's real shape. Step by step waits once a step, at its
end; before session 48 the loop also waited before each update (the divergence check, now on the device), so the
ratio understates what the session's loop gained.

    python bench/product_loop.py --model llama-3.2-1b --method lora --out product_loop.json
    options: --seq 4096 --batch 2 --steps 60 --warmup 20 --order off,on,on,off

Each run is its own process (`bench.common.run_isolated`) on the shipped `arithmetic_chat` sample, packed into
rows of --seq tokens, with the product's defaults otherwise (checkpointing and CUDA graphs auto, metrics every
step). Throughput is wall time, not the per-step figure the metrics report (that one leaves out the host's
work between steps, which is what running ahead hides): real tokens of the steps after --warmup over the
`elapsed_s` between them. The order runs ABBA, so a drift over the call cancels; the ratio is ahead over step by
step, each the mean of its runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import mean_by, runs_in_order  # noqa: E402


def steady(rows: list[dict], tokens: dict[int, int], warmup: int) -> dict[str, float]:
    """Tokens a second over the steps after `warmup` by the wall clock: their real `tokens` (by 1-based step)
    over the `elapsed_s` between their reports (metrics.jsonl rows: step, tokens_per_s, elapsed_s...)."""
    steps = [r for r in rows if "elapsed_s" in r and "tokens_per_s" in r]
    if len(steps) <= warmup + 1:
        raise ValueError(f"{len(steps)} steps reported, more than {warmup + 1} needed")
    first, timed = steps[warmup], steps[warmup + 1:]
    wall = timed[-1]["elapsed_s"] - first["elapsed_s"]
    return {"tokens_per_s": sum(tokens[int(r["step"])] for r in timed) / wall, "steps": len(timed), "wall_s": wall,
            "reported_tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed)}


def one(args: argparse.Namespace) -> dict:
    """One run of the product loop in this process, ahead or not: its reported rows and each step's tokens."""
    from bench.matrix_models import build_model_dir
    from kestrel.config import config_from_dict
    from kestrel.training import sft
    from kestrel.training.metrics import Callback
    from kestrel.training.run import run

    if args.one == "off":
        sft.runs_ahead = lambda device: False  # the bench's switch; the product has none
    rows: list[dict] = []
    tokens: dict[int, int] = {}
    accumulate = sft.accumulate

    def counted(s, step):  # type: ignore[no-untyped-def]
        window = accumulate(s, step)
        tokens[step + 1] = window[2]
        return window

    sft.accumulate = counted

    class Rows(Callback):
        def on_step(self, metrics: dict) -> None:
            rows.append(dict(metrics))

    folder = build_model_dir(args.model)
    with tempfile.TemporaryDirectory() as out:
        cfg = config_from_dict(dict(model=str(folder), method=args.method, dataset="arithmetic_chat", output_dir=out,
                                    max_seq_length=args.seq, batch_size=args.batch, packing=True, max_steps=args.steps,
                                    save_steps=0, seed=0, report_to=[]))
        result = run(cfg, [Rows()])
    if result.status != "completed":
        raise RuntimeError(f"{result.status}: {result.error}")
    return {"ahead": args.one, "rows": rows, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--method", default="lora", choices=["lora", "qlora"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--order", default="off,on,on,off")
    ap.add_argument("--one", choices=["on", "off"], help="(internal) one run in this process")
    ap.add_argument("--out", type=Path, default=Path("product_loop.json"))
    args = ap.parse_args()
    if args.one:
        args.out.write_text(json.dumps(one(args)))
        return
    passed = ["--model", args.model, "--method", args.method, "--seq", str(args.seq), "--batch", str(args.batch),
              "--steps", str(args.steps)]
    runs = runs_in_order(__file__, passed, args.order, "ahead")
    for got in runs:
        if "error" in got:
            continue
        got.update(steady(got.pop("rows"), {int(k): v for k, v in got.pop("tokens").items()}, args.warmup))
        print(f"{got['ahead']}: {got['tokens_per_s']:,.0f} tokens/s by the wall clock over {got['steps']} steps "
              f"(the steps' own median {got['reported_tokens_per_s']:,.0f})", flush=True)
    mean = mean_by(runs, "ahead", "tokens_per_s")
    if {"on", "off"} <= mean.keys():
        print(f"ahead / step by step: {mean['on'] / mean['off']:.3f}x", flush=True)
    args.out.write_text(json.dumps(dict(model=args.model, method=args.method, seq=args.seq, batch=args.batch,
                                        runs=runs, mean=mean), indent=1))


if __name__ == "__main__":
    main()
