"""The fused linear cross-entropy against Liger-Kernel's, and the choices inside ours, in one process.

Two parts, at the Llama-3 loss shape (8,192 tokens x 4,096 hidden, vocabulary 128,256, bf16):
- the whole op, forward + backward, trainable head and frozen head (LoRA), in interleaved rounds:
  Kestrel and Liger; the median of each round's median, and the peak extra memory;
- the per-chunk kernel alone on one (256, 128256) chunk of logits (loss, lse and the in-place
  gradient), for several vocabulary blocks and warp counts, beside Liger's kernel on the same chunk.

Run from the repository root, Liger-Kernel on PYTHONPATH:
    PYTHONPATH=$PWD/.gpu-anchors:$PYTHONPATH python bench/ce_variants.py --out ce_variants.json
About a minute on one H100.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench.kernels as bk  # noqa: E402  (sets KESTREL_KERNELS=triton)
from bench.common import copy_bandwidth  # noqa: E402
from kestrel.kernels import cross_entropy as ce  # noqa: E402
from kestrel.kernels._launch import launch  # noqa: E402

try:
    from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
except Exception as exc:  # noqa: BLE001 - without Liger only our own variants are timed
    print(f"liger_kernel unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
    liger_fused_linear_cross_entropy = liger_cross_entropy_kernel = None

N, H, V, CHUNK = 8192, 4096, 128256, 256


def whole_op(rounds: int, iters: int, frozen_head: bool) -> list[dict]:
    inputs = {"h": bk.randn(N, H, requires_grad=True),
              "w": bk.randn(V, H, scale=0.02, requires_grad=not frozen_head),
              "y": torch.randint(0, V, (N,), device="cuda")}
    leaves = lambda s: (s["h"],) if frozen_head else (s["h"], s["w"])  # noqa: E731

    def step(fn):
        def run(s):
            out = fn(s["h"], s["w"], s["y"])
            out = out[0] if isinstance(out, (tuple, list)) else out
            return bk.grad_of(out.float(), leaves(s), None)
        return run

    impls = {"kestrel": step(ce.fused_linear_cross_entropy)}
    if liger_fused_linear_cross_entropy is not None:
        impls["liger"] = step(liger_fused_linear_cross_entropy)
    reference = impls["kestrel"](inputs)
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(rounds):
        for name, fn in impls.items():
            times[name].append(bk.time_steps(fn, inputs, lambda i: i, warmup=2, iters=iters))
    rows = []
    for name, fn in impls.items():
        got = fn(inputs)
        abs_err, rel_err = bk.max_errors(got, reference)
        rows.append({"part": "whole op", "head": "frozen" if frozen_head else "trainable", "impl": name,
                     "ms": statistics.median(times[name]), "round_ms": times[name],
                     "peak_extra_gib": bk.peak_extra_gib(fn, inputs, lambda i: i),
                     "rel_err_vs_kestrel": rel_err})
        del got
        torch.cuda.empty_cache()
    return rows


def _time_kernel(fn, logits0: torch.Tensor, iters: int) -> float:
    """Median ms of fn(logits) on a fresh copy of the chunk each time (the copy untimed)."""
    work = logits0.clone()
    times = []
    for i in range(iters + 3):
        work.copy_(logits0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(work)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def chunk_kernel(iters: int) -> list[dict]:
    logits0 = (3.0 * torch.randn(CHUNK, V, device="cuda")).to(torch.bfloat16)
    labels = torch.randint(0, V, (CHUNK,), device="cuda")
    loss = torch.empty(CHUNK, device="cuda")
    lse = torch.empty(CHUNK, device="cuda")
    scale = torch.full((), 1.0 / N, device="cuda")
    rows = []

    def ours(block: int, warps: int):
        return lambda x: launch(ce._ce_chunk_kernel, (CHUNK,), x, x.stride(0), labels, loss, lse, scale, 0, V,
                                -100, 1.0, 1.0, False, True, True, block, num_warps=warps)

    for block, warps in ((4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32)):
        rows.append({"part": "chunk kernel", "impl": f"kestrel block {block} warps {warps}",
                     "ms": _time_kernel(ours(block, warps), logits0, iters)})
    if liger_cross_entropy_kernel is not None:
        loss2 = torch.zeros(CHUNK, device="cuda")

        def liger(x):
            liger_cross_entropy_kernel[(CHUNK,)](
                X_ptr=x, X_stride=x.stride(0), Y_ptr=labels, Y_stride=1, weight_ptr=None, loss_ptr=loss2,
                z_loss_ptr=None, loss_stride=1, token_accuracy_ptr=None, token_accuracy_stride=0,
                predicted_tokens_ptr=None, predicted_tokens_stride=0, n_cols=V, n_non_ignore=N,
                sum_non_ignore_weight=N, weight_sum=0.0, ignore_index=-100, lse_square_scale=0.0,
                label_smoothing=0.0, reduction="mean", softcap=None, RETURN_Z_LOSS=False,
                RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False, BLOCK_SIZE=32768,
                HAS_WEIGHT=False, HAS_SOFTCAPPING=False, HAS_GRADIENTS=True, num_warps=32)
        rows.append({"part": "chunk kernel", "impl": "liger block 32768 warps 32",
                     "ms": _time_kernel(liger, logits0, iters)})
    chunk_bytes = 3 * CHUNK * V * 2  # read twice, write once
    for r in rows:
        r["gbs"] = chunk_bytes / (r["ms"] * 1e-3) / 1e9
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/ce_variants.py needs a CUDA device")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth(torch.device("cuda")) / 1e9
    rows = chunk_kernel(50)
    for frozen in (False, True):
        rows += whole_op(args.rounds, args.iters, frozen)
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:,.0f} GB/s")
    for r in rows:
        extra = {k: v for k, v in r.items() if k not in ("part", "impl", "ms")}
        print(f"{r['part']:12} {r.get('head', ''):9} {r['impl']:32} {r['ms']:8.3f} ms  {extra}")
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs,
                                    "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
