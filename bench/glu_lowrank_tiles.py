"""Tile sweep for the GLU with the adapters' rank terms inside (`kestrel.kernels.glu_lowrank`), against the
plain GLU kernels (`kestrel.kernels.glu`) on the same (M, I): how much the rank terms cost over a pass the
MLP makes anyway.

    python bench/glu_lowrank_tiles.py --out glu_lowrank_tiles.json

Each candidate tiling (rows x columns of a program's tile, warps, and the row blocks a program takes in turn)
is timed forward and backward (`triton.testing.do_bench_cudagraph`) at every shape, its outputs
checked against the shipped tiling's. The choice is made on the --tune shapes (least geometric mean of the
time over the plain GLU's, forward plus backward) and then reported on the --check shapes, which it was not
chosen on. Shapes are M x I x r: M tokens, I the MLP's width, r the adapter rank. `--smoke` runs two
candidates at tiny shapes on the CPU interpreter.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from kestrel.kernels import glu  # noqa: E402
from kestrel.kernels.glu_lowrank import DEFAULT_TILES, Tiles, glu_lowrank, glu_lowrank_backward_  # noqa: E402

Shape = tuple[int, int, int]


def _shapes(text: str) -> list[Shape]:
    return [tuple(int(v) for v in part.split("x")) for part in text.split(",") if part]  # type: ignore[misc]


def _candidates(smoke: bool) -> list[Tiles]:
    if smoke:
        return [DEFAULT_TILES, Tiles(32, 64, 4)]
    # Session 41's sweep of 16-128 x 64-256 at 4-8 warps found 16 x 128 at 4 fastest: tiles around it, each
    # program taking 1, 4 or 8 row blocks in turn (V's tiles read once for them all)
    shapes = [(16, 128, 4), (8, 256, 4), (32, 128, 4), (16, 256, 4), (8, 128, 2), (16, 128, 2)]
    near = [Tiles(r, c, w, s) for (r, c, w), s in itertools.product(shapes, (1, 4, 8))]
    return [*near, Tiles(64, 128, 8)]


def _time_us(fn) -> float:
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=60)


def _inputs(shape: Shape, device: str):
    m, i, r = shape
    gen = torch.Generator().manual_seed(m + i + r)
    e, g, dh = (torch.randn(m, i, generator=gen).to(device, torch.bfloat16) for _ in range(3))
    xa = (torch.randn(m, 2 * r, generator=gen) / r**0.5).to(device, torch.bfloat16)
    vs = tuple((torch.randn(i, r, generator=gen) * 1e-2).to(device, torch.bfloat16) for _ in range(2))
    return e, g, (xa[:, :r], xa[:, r:]), vs, dh


def _plain(shape: Shape, device: str) -> dict[str, float]:
    e, g, _, _, dh = _inputs(shape, device)
    fwd = _time_us(lambda: glu.glu_forward(e, g, False))
    bwd = _time_us(lambda: glu.glu_backward(dh, e, g, False, inplace=True))
    return {"forward_us": fwd, "backward_us": bwd}


def _run(shape: Shape, tiles: Tiles, device: str, reference: dict | None) -> dict:
    e, g, us, vs, dh = _inputs(shape, device)
    h = glu_lowrank(e, g, us, vs, False, tiles)
    e2, g2 = e.clone(), g.clone()
    de, dg = (t.clone() for t in glu_lowrank_backward_(dh, e2, g2, us, vs, False, tiles))  # e2, g2 are written again
    if reference is not None:  # another tiling sums in another order: equal within a unit or so of bf16
        for name, got in (("h", h), ("de", de), ("dg", dg)):
            torch.testing.assert_close(got.float(), reference[name].float(), rtol=2e-2, atol=2e-2,
                                       msg=lambda m, n=name: f"{tiles} {shape} {n}: {m}")
    fwd = _time_us(lambda: glu_lowrank(e, g, us, vs, False, tiles))
    # the backward writes over E and G: timed on copies refreshed by nothing (values do not change the time)
    bwd = _time_us(lambda: glu_lowrank_backward_(dh, e2, g2, us, vs, False, tiles))
    return {"forward_us": fwd, "backward_us": bwd, "outputs": {"h": h, "de": de, "dg": dg}}


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tune", default="8192x8192x16,8192x14336x16,2048x4864x16",
                    help="M x I x r shapes the choice is made on")
    ap.add_argument("--check", default="4096x11008x16,16384x5632x32",
                    help="shapes the chosen tiling is reported on, not chosen on")
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tune, check = _shapes(args.tune), _shapes(args.check)
    if args.smoke:
        tune, check = [(20, 200, 16)], [(9, 130, 8)]
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shapes": {}}
    for shape in tune + check:
        plain = _plain(shape, device)
        ref = _run(shape, DEFAULT_TILES, device, None)["outputs"]
        rows = {}
        for tiles in _candidates(args.smoke):
            r = _run(shape, tiles, device, ref)
            r.pop("outputs")
            r["over_plain"] = (r["forward_us"] + r["backward_us"]) / (plain["forward_us"] + plain["backward_us"])
            rows[str(tuple(tiles))] = r
        results["shapes"]["x".join(map(str, shape))] = {"plain": plain, "tilings": rows}
        Path(args.out).write_text(json.dumps(results, indent=1))  # a run cut short keeps the shapes it timed
        print(shape, "plain", plain, flush=True)
    keys = list(next(iter(results["shapes"].values()))["tilings"])
    names = {s: "x".join(map(str, s)) for s in tune + check}

    def score(key: str, shapes: list[Shape]) -> float:
        return _geomean([results["shapes"][names[s]]["tilings"][key]["over_plain"] for s in shapes])

    chosen = min(keys, key=lambda k: score(k, tune))
    results["chosen"] = {"tiles": chosen, "tune_over_plain": score(chosen, tune), "check_over_plain": score(chosen, check),
                         "default_tune": score(str(tuple(DEFAULT_TILES)), tune),
                         "default_check": score(str(tuple(DEFAULT_TILES)), check),
                         "best_per_check_shape": {names[s]: min(keys, key=lambda k, s=s: score(k, [s])) for s in check}}
    for key in sorted(keys, key=lambda k: score(k, tune))[:8]:
        print(f"{key}: tune {score(key, tune):.3f}x plain, check {score(key, check):.3f}x")
    print("chosen", results["chosen"])
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
