"""Scaling of one run over several GPUs of one host: the same config with `devices: 1` and
`devices: N`, each through `python -m kestrel train` in its own process, on a random-init model
at a real model's shape (`bench/model_shapes.py`), rows of `--seq` tokens. LARGE_MODELS (the 70B
shape) are built as NF4 checkpoints (`bench/large_models.py`) and run with `--method qlora`.

    python bench/multi_gpu.py --model llama-3.1-8b --method lora --devices 1,2 --steps 12 --out $OUT/multi.json

Tokens/s is the median of the steps after --skip (the CUDA-graph chooser times its first steps),
from rank 0's metrics (tokens summed over ranks); scaling = tokens/s(N) / (N x tokens/s(1)).
Peak memory per GPU from the `vram_peak_gib/gpuR` metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.large_models import build_nf4_model_dir  # noqa: E402
from bench.matrix_models import build_model_dir  # noqa: E402
from bench.model_shapes import LARGE_MODELS  # noqa: E402

WORDS = ("the of and to in is was for on are with as by at from this that which or be an have "
         "model data train value layer token step rate batch loss weight").split()


def write_dataset(path: Path, rows: int, words: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n")
    return path


def run_one(model: Path, data: Path, out: Path, args: argparse.Namespace, devices: int) -> dict:
    config = dict(model=str(model), method=args.method, dataset=str(data), dataset_format="text",
                  output_dir=str(out), max_seq_length=args.seq, batch_size=args.batch, grad_accum=1,
                  max_steps=args.steps, save_steps=0, gradient_checkpointing=args.checkpointing, devices=devices,
                  learning_rate=1e-4, lr_scheduler="constant", train_on_responses_only=False)
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kestrel", "train", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if (
        out / "metrics.jsonl").is_file() else []
    steps = [m for m in steps if "tokens_per_s" in m]
    timed = [m["tokens_per_s"] for m in steps[args.skip:]]
    last = steps[-1] if steps else {}
    return {"devices": devices, "rc": proc.returncode, "wall_s": wall, "steps": len(steps),
            "tokens_per_s": statistics.median(timed) if timed else None,
            "peak_gib": {k: v for k, v in last.items() if k.startswith("vram_peak_gib")},
            "losses": [round(m["loss"], 4) for m in steps],
            "step_tokens_per_s": [round(m["tokens_per_s"]) for m in steps],
            "tail": (proc.stdout + proc.stderr)[-1500:] if proc.returncode else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--method", default="lora")
    ap.add_argument("--devices", default="1,2")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=6)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--checkpointing", default="standard")  # the product's default
    ap.add_argument("--timeout", type=int, default=500)
    ap.add_argument("--out", default="multi_gpu.json")
    args = ap.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "kestrel-multi"
    work.mkdir(parents=True, exist_ok=True)
    if args.model in LARGE_MODELS and args.method != "qlora":
        ap.error(f"{args.model} is built as an NF4 checkpoint (bench/large_models.py): run it with --method qlora")
    model = build_nf4_model_dir(args.model) if args.model in LARGE_MODELS else build_model_dir(args.model)
    counts = [int(d) for d in args.devices.split(",")]
    data = write_dataset(work / "rows.jsonl", rows=args.steps * args.batch * max(counts), words=int(args.seq * 1.2))
    results = []
    for n in counts:
        results.append(run_one(model, data, work / f"run-{args.method}-{n}-{time.time_ns()}", args, n))
        print(json.dumps(results[-1]), flush=True)
    one = next((r["tokens_per_s"] for r in results if r["devices"] == 1), None)
    for r in results:
        if one and r["tokens_per_s"]:
            r["scaling"] = r["tokens_per_s"] / (r["devices"] * one)
    report = {"model": args.model, "method": args.method, "seq": args.seq, "batch": args.batch, "results": results}
    Path(args.out).write_text(json.dumps(report, indent=1))
    for r in results:
        print(f"devices {r['devices']}: {r['tokens_per_s']} tok/s, scaling {r.get('scaling')}, peak {r['peak_gib']}")


if __name__ == "__main__":
    main()
