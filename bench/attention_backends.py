"""SDPA back ends at the training shape: forward and forward+backward time of causal attention.

    python bench/attention_backends.py [--batch 2 --seq 2048 --heads 32 --kv-heads 8] --out a.json

For each of torch's SDPA back ends (flash, cuDNN, memory-efficient) and each way of handing it
grouped-query K/V (`enable_gqa=True`, or K/V repeated to the query heads first), checks the
output and gradients against the flash back end's, then times forward and forward+backward
(triton's do_bench, median). Reports TFLOP/s on causal FLOPs (4 B H T^2 D / 2 forward, 2.5x
that for forward+backward).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: str) -> torch.Tensor:
    if gqa == "repeat":
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    shape_q, shape_kv = (a.batch, a.heads, a.seq, a.dim), (a.batch, a.kv_heads, a.seq, a.dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
    fwd_flops = 4 * a.batch * a.heads * a.seq * a.seq * a.dim / 2
    ref = None
    rows = []
    for name, backend in BACKENDS.items():
        for gqa in ("enable_gqa", "repeat"):
            row = {"backend": name, "gqa": gqa}
            try:
                with sdpa_kernel([backend]):
                    out = _call(q, k, v, gqa)
                    grads = torch.autograd.grad(out, (q, k, v), dout)
                    if ref is None:
                        ref = (out, *grads)
                    row["max_err"] = max((x - r).abs().max().item() for x, r in zip((out, *grads), ref))

                    def fwd() -> None:
                        with torch.no_grad():
                            _call(q, k, v, gqa)

                    def fwd_bwd() -> None:
                        torch.autograd.grad(_call(q, k, v, gqa), (q, k, v), dout)

                    row["fwd_ms"] = triton.testing.do_bench(fwd, rep=200)
                    row["fwd_bwd_ms"] = triton.testing.do_bench(fwd_bwd, rep=300)
                row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
                row["fwd_bwd_tflops"] = 3.5 * fwd_flops / row["fwd_bwd_ms"] / 1e9
            except RuntimeError as e:  # a back end that refuses the shape
                row["error"] = str(e).splitlines()[0][:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
