"""How many rows a chunk of the fused loss needs before its products stop losing speed, on this GPU.

The fused linear cross-entropy (`kestrel.kernels.cross_entropy`) holds one `(C, V)` chunk of logits at a time.
With the LM head frozen (LoRA) the floor is 512 rows (`_chunk_size`), a 148 MiB buffer at Qwen's 151,936-entry
vocabulary, the largest block live at a small model's reserved peak (bench/RESULTS.md, session 46). Each chunk
reads the whole head `W (V, H)` twice (the logits, then the input gradient), so a chunk of C rows does about C
multiply-adds per byte of W read: below the device's ridge point (its matrix-product rate over its memory
bandwidth) the products wait on memory. The model to test: the smallest multiple of 128 rows at or above the
ridge point loses little against 512, and halves the buffer where the ridge is under 256.

For every (hidden, vocabulary) pair of the matrix's models and N = 4,096 and 8,192 tokens: the loss's forward and
backward (frozen head, bf16) with chunks of 128-768 rows, median time and peak extra memory, and the model's chunk
against 512. One process, about a minute on one H200:

    python bench/ce_floor.py --out ce_floor.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import copy_bandwidth, cuda_time  # noqa: E402
from bench.model_shapes import MODELS  # noqa: E402
from bench.train import matmul_tflops  # noqa: E402
from kestrel.kernels import cross_entropy as ce  # noqa: E402

CHUNKS = (128, 256, 384, 512, 768)


def ridge_rows(flops_per_s: float, bytes_per_s: float) -> int:
    """The model's chunk: the smallest multiple of 128 rows at or above the ridge point (flops / bytes), 128 to 512.
    A chunk of C rows multiplies each 2-byte weight of W by C rows (2 C flops): C flops a byte read, so the products
    stop waiting on memory where C reaches the ridge."""
    ridge = flops_per_s / bytes_per_s  # flop per byte
    return int(min(512, max(128, 128 * math.ceil(ridge / 128))))


def one(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: int) -> dict:
    """The frozen-head loss of hidden (N, H) through weight (V, H), forward and backward, with chunks of `rows` rows:
    median seconds, peak extra bytes."""
    n, v = hidden.shape[0], weight.shape[0]
    original = ce._chunk_size
    ce._chunk_size = lambda n_, h_, v_, frozen=False: min(rows, n_)
    try:
        def step() -> None:
            ce.fused_linear_cross_entropy(hidden, weight, labels).backward()
            hidden.grad = None

        seconds = cuda_time(step, warmup=3, iters=10)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    finally:
        ce._chunk_size = original
    return {"rows": rows, "seconds": seconds, "peak_extra_bytes": extra, "buffer_bytes": min(rows, n) * v * 2}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="4096,8192")
    args = ap.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))  # bytes moved a second, read and write together
    flops = matmul_tflops() * 1e12
    model_rows = ridge_rows(flops, bandwidth)
    shapes = sorted({(m["hidden_size"], m["vocab_size"]) for m in MODELS.values()})
    results, lines = [], []
    for n in (int(t) for t in args.tokens.split(",")):
        for h, v in shapes:
            hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h**0.5
            labels = torch.randint(0, v, (n,), device="cuda")
            runs = {rows: one(hidden, weight, labels, rows) for rows in CHUNKS}
            del hidden, weight, labels
            at512, chosen = runs[512], runs[model_rows]
            results.append({"tokens": n, "hidden": h, "vocab": v, "runs": list(runs.values()),
                            "model_rows": model_rows, "model_vs_512": chosen["seconds"] / at512["seconds"]})
            lines.append(f"N {n:5d}  H {h:5d}  V {v:6d}  " + "  ".join(
                f"{rows}: {r['seconds'] * 1e3:6.2f} ms {r['peak_extra_bytes'] / 2**20:5.0f} MiB" for rows, r in runs.items())
                + f"  | model {model_rows}: {chosen['seconds'] / at512['seconds']:.3f}x the time of 512, "
                  f"{(at512['peak_extra_bytes'] - chosen['peak_extra_bytes']) / 2**20:.0f} MiB less")
    head = (f"{torch.cuda.get_device_name()}: matrix products {flops / 1e12:.0f} TFLOP/s, memory {bandwidth / 1e9:.0f} GB/s, "
            f"ridge {flops / bandwidth:.0f} flop/byte: model chunk {model_rows} rows")
    report = "\n".join([head, *lines])
    print(report, flush=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "matmul_flops": flops,
                                          "bandwidth": bandwidth, "model_rows": model_rows, "shapes": results,
                                          "report": report}, indent=1))


if __name__ == "__main__":
    main()
