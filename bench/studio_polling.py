"""Does a room full of studio tabs slow training down? Twenty polling sessions vs none.

A training job runs through `jobs` (its own worker process, as from the studio) three times on
the same config: alone, with `--sessions` poller processes, and alone again (the two quiet runs
bound the run-to-run noise). Each poller does what one open Runs tab does every `POLL_S` second:
the job list, the chart series (downsampled, as `kestrel.studio.handlers.runs.chart_frames` asks) and the
log tail, through the same `jobs` functions the handler calls (the studio's gradio/pandas
formatting runs in the studio process on the CPU and is left out). Throughput is the median of
the per-step `tokens_per_s` the worker wrote to the store, warm-up steps excluded.

    python bench/studio_polling.py --out polling.json [--sessions 20 --steps 80]

Runs on the GPU machine (the job trains on cuda:0) or, slowly, on a CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POLL_S = 1.0  # kestrel.studio.components.runs.POLL_S
CHART_POINTS = 500  # kestrel.studio.handlers.runs.CHART_POINTS
LOG_LINES = 60  # kestrel.studio.handlers.runs.LOG_LINES


def _model_dir(root: Path, hidden: int) -> Path:
    """A random Llama (hidden 1024: about 0.3 B parameters, steps of tens of ms on a GPU, so
    interference would show)."""
    from transformers import AutoTokenizer

    from kestrel.paths import ASSETS
    from tests.support.tiny import tiny_model

    folder = root / "model"
    if not (folder / "config.json").exists():
        tok = AutoTokenizer.from_pretrained(ASSETS / "demo")
        tiny_model("llama", len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=8,
                   num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 256),
                   head_dim=min(128, hidden)).save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def _poller(home: str, stop_at: float) -> int:
    """One browser tab's Runs polling until `stop_at`; returns how many polls it made."""
    os.environ["KESTREL_HOME"] = home
    from kestrel import jobs

    polls = 0
    while time.time() < stop_at:
        started = time.time()
        job_list = jobs.list_jobs()
        running = [j for j in job_list if j.status == "running"] or job_list
        if running:
            jobs.metric_series(running[0].id, None, CHART_POINTS)
            jobs.log_tail(running[0].id, LOG_LINES)
        polls += 1
        time.sleep(max(0.0, POLL_S - (time.time() - started)))
    return polls


def _train_once(model: Path, args: argparse.Namespace, sessions: int) -> dict:
    from kestrel import jobs

    config = dict(model=str(model), method="lora", dataset="arithmetic_chat", max_seq_length=args.seq, packing=True,
                  batch_size=8, max_steps=args.steps, learning_rate=1e-4, save_steps=0, seed=0,
                  gradient_checkpointing="off", dtype="bf16" if args.device != "cpu" else "auto")
    job_id = jobs.submit(config, device=args.device)
    pool = None
    if sessions:
        ctx = mp.get_context("spawn")
        pool = ctx.Pool(sessions)
        stop_at = time.time() + 24 * 3600
        # Pollers run until the job ends; they are terminated below.
        pool.starmap_async(_poller, [(os.environ["KESTREL_HOME"], stop_at)] * sessions)
    job = jobs.wait(job_id, timeout=args.timeout)
    if pool is not None:
        pool.terminate()
        pool.join()
    if job.status != "completed":
        return {"sessions": sessions, "status": job.status, "error": job.error}
    values = [p.value for p in jobs.metric_series(job_id, ["tokens_per_s"], 100_000) if p.step > args.warmup]
    return {"sessions": sessions, "status": job.status, "median_tokens_per_s": statistics.median(values),
            "steps_measured": len(values)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--hidden", type=int, default=1024, help="model width (a smaller one for a CPU smoke run)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["KESTREL_HOME"] = tempfile.mkdtemp(prefix="kestrel-polling-")
    model = _model_dir(Path(os.environ["KESTREL_HOME"]), args.hidden)
    runs = [_train_once(model, args, n) for n in (0, args.sessions, 0)]
    quiet = [r["median_tokens_per_s"] for r in runs if r["sessions"] == 0 and "median_tokens_per_s" in r]
    busy = runs[1].get("median_tokens_per_s")
    summary = {"runs": runs, "device": args.device}
    if quiet and busy:
        summary["slowdown_vs_quiet_mean"] = 1 - busy / statistics.mean(quiet)
        summary["quiet_spread"] = (max(quiet) - min(quiet)) / statistics.mean(quiet)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
