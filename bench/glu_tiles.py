"""Tile sweep for the GLU kernels (kernels/glu.py) against Liger-Kernel's SwiGLU and GeGLU.

    python bench/glu_tiles.py --out glu_tiles.json        (Liger-Kernel on PYTHONPATH, optional)

Session 13 found SwiGLU at 96-97% of the copy rate with 1,024-column tiles at 4 warps, and
Liger's (one program per whole row) at 99-100%; session 14's run of this sweep chose the shipped
tiles (`kestrel.kernels.glu._tiles`). This times the forward and the backward kernels alone
(`triton.testing.do_bench_cudagraph`: launches replayed from a CUDA graph) at the 8B MLP's width
for every BLOCK in {1024 ... 16384} and warps in {4, 8, 16}, checks every output against the
shipped configuration, and reports GB/s and the share of the measured copy rate, with Liger's
forward and backward beside them. `--smoke` runs two tiny configs on the CPU interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from bench.common import copy_bandwidth  # noqa: E402
from kestrel.kernels import glu  # noqa: E402
from kestrel.kernels._launch import launch  # noqa: E402


def _forward(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, gelu: bool, block: int, warps: int) -> None:
    grid = (a.shape[0], triton.cdiv(a.shape[1], block))
    launch(glu._glu_fwd_kernel, grid, c, c.stride(0), a, a.stride(0), b, b.stride(0), a.shape[1], gelu, block,
           num_warps=warps)


def _backward(dc, a, b, da, db, gelu: bool, block: int, warps: int) -> None:
    grid = (a.shape[0], triton.cdiv(a.shape[1], block))
    launch(glu._glu_bwd_kernel, grid, da, da.stride(0), db, db.stride(0), dc, dc.stride(0), a, a.stride(0),
           b, b.stride(0), a.shape[1], gelu, block, num_warps=warps)


def _time_us(fn) -> float:
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100)


def _liger(a: torch.Tensor, b: torch.Tensor, dc: torch.Tensor, gelu: bool) -> dict[str, float]:
    """Liger's own SwiGLU or GeGLU forward and backward (its host functions: the graph replay
    leaves only their kernels). Its backward writes over its inputs: timed on copies (values do
    not change the time)."""
    try:
        if gelu:
            from liger_kernel.ops.geglu import geglu_backward as backward, geglu_forward as forward
        else:
            from liger_kernel.ops.swiglu import swiglu_backward as backward, swiglu_forward as forward
    except Exception as exc:  # noqa: BLE001 - an optional baseline only drops its rows
        print(f"liger unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {}
    a2, b2 = a.clone(), b.clone()
    return {"fwd_us": _time_us(lambda: forward(a, b)), "bwd_us": _time_us(lambda: backward(a2, b2, dc))}


def sweep(rows: int, cols: int, gelu: bool, blocks: list[int], warps: list[int], device: str,
          copy_gbs: float) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    a, b, dc = (torch.randn(rows, cols, device=device, generator=gen).bfloat16() for _ in range(3))
    c, da, db = torch.empty_like(a), torch.empty_like(a), torch.empty_like(a)
    _, shipped_block, shipped_warps = glu._tiles(rows, cols, gelu)
    _forward(a, b, c, gelu, shipped_block, shipped_warps)
    _backward(dc, a, b, da, db, gelu, shipped_block, shipped_warps)
    want = [c.clone(), da.clone(), db.clone()]
    a2, b2 = a.clone(), b.clone()  # scratch for the in-place backward (values do not change the time)
    elem = rows * cols * 2
    act = "geglu" if gelu else "swiglu"
    rows_out = []
    for block in blocks:
        for w in warps:
            fwd_us = _time_us(lambda: _forward(a, b, c, gelu, block, w))
            bwd_us = _time_us(lambda: _backward(dc, a, b, da, db, gelu, block, w))
            same = all(torch.equal(x, y) for x, y in zip((c, da, db), want))
            # In place, as training runs it (and as Liger's does): gradients over gate and up.
            bwd_inplace_us = _time_us(lambda: _backward(dc, a2, b2, a2, b2, gelu, block, w))
            total = fwd_us + bwd_us
            rows_out.append({"act": act, "shape": f"{rows}x{cols}", "block": block, "warps": w, "fwd_us": fwd_us,
                             "bwd_us": bwd_us, "bwd_inplace_us": bwd_inplace_us,
                             "same_as_shipped": same, "pct_of_copy": 100 * 8 * elem / (total * 1e-6) / 1e9 / copy_gbs})
            print(json.dumps(rows_out[-1]), flush=True)
    liger = _liger(a, b, dc, gelu)
    if liger:
        total = liger["fwd_us"] + liger["bwd_us"]
        rows_out.append({"act": act, "shape": f"{rows}x{cols}", "impl": "liger", **liger,
                         "pct_of_copy": 100 * 8 * elem / (total * 1e-6) / 1e9 / copy_gbs})
        print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--acts", default="swiglu,geglu", help="comma-separated: swiglu, geglu")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        shapes, blocks, warps = [(3, 100)], [64, 128], [4]
    else:
        shapes, blocks, warps = [(8192, 14336), (32768, 14336)], [1024, 2048, 4096, 8192, 16384], [4, 8, 16]
    copy_gbs = copy_bandwidth(torch.device(device)) / 1e9
    gelus = [act == "geglu" for act in args.acts.split(",")]
    results = [r for gelu in gelus for rows, cols in shapes
               for r in sweep(rows, cols, gelu, blocks, warps, device, copy_gbs)]
    Path(args.out).write_text(json.dumps({"copy_gbs": copy_gbs, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
