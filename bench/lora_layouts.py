"""How to add a LoRA term to a base matrix product: three layouts timed at the 8B shapes.

    python bench/lora_layouts.py --out layouts.json

For y = x W^T + (x A^T) B^T with x (M, in), W (out, in), A (r, in), B (out, r):
- separate:  y = x W^T, then y += xa B^T (a second pass over y: read and write)
- c_first:   y = xa B^T, then y += x W^T with beta = 1 (the big product reads y in its epilogue)
- k_concat:  y = [x | xa] [W | B]^T, one product with K = in + r (operands laid out beforehand)
and for the input gradient dx = dy W + dyb A (dy (M, out), dyb (M, r)): `separate` and `c_first`.
Times are per call, CUDA events, median of 20.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import cuda_time  # noqa: E402

SHAPES = {"q/o": (4096, 4096), "gate/up": (14336, 4096), "down": (4096, 14336), "k/v": (1024, 4096)}


def forward_variants(m: int, out: int, inp: int, r: int) -> dict[str, float]:
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(m, inp, device=dev, dtype=dt)
    w = torch.randn(out, inp, device=dev, dtype=dt) / inp**0.5
    a = torch.randn(r, inp, device=dev, dtype=dt) / inp**0.5
    b = torch.randn(out, r, device=dev, dtype=dt)
    xk = torch.randn(m, inp + r, device=dev, dtype=dt)
    wk = torch.randn(out, inp + r, device=dev, dtype=dt)

    def separate():
        xa = x @ a.t()
        return torch.mm(x, w.t()).addmm_(xa, b.t())

    def c_first():
        xa = x @ a.t()
        return torch.mm(xa, b.t()).addmm_(x, w.t())

    def k_concat():
        torch.mm(xk[:, :inp], a.t(), out=torch.empty(m, r, device=dev, dtype=dt))
        return torch.mm(xk, wk.t())

    def base_only():
        return torch.mm(x, w.t())

    return {name: cuda_time(fn, warmup=5, iters=20) * 1e6 for name, fn in
            [("base_only", base_only), ("separate", separate), ("c_first", c_first), ("k_concat", k_concat)]}


def backward_variants(m: int, out: int, inp: int, r: int) -> dict[str, float]:
    dev, dt = "cuda", torch.bfloat16
    dy = torch.randn(m, out, device=dev, dtype=dt)
    w = torch.randn(out, inp, device=dev, dtype=dt) / out**0.5
    a = torch.randn(r, inp, device=dev, dtype=dt)
    b = torch.randn(out, r, device=dev, dtype=dt)

    def separate():
        dyb = dy @ b
        return torch.mm(dy, w).addmm_(dyb, a)

    def c_first():
        dyb = dy @ b
        return torch.mm(dyb, a).addmm_(dy, w)

    def base_only():
        return torch.mm(dy, w)

    return {name: cuda_time(fn, warmup=5, iters=20) * 1e6 for name, fn in
            [("base_only", base_only), ("separate", separate), ("c_first", c_first)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = {}
    for name, (out, inp) in SHAPES.items():
        res[name] = {"forward_us": forward_variants(args.tokens, out, inp, args.rank),
                     "input_grad_us": backward_variants(args.tokens, out, inp, args.rank)}
        print(name, json.dumps(res[name]), flush=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), **res}, indent=1))


if __name__ == "__main__":
    main()
