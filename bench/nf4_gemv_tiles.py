"""Tile sweep for kernels/nf4_gemv.py at the Llama-3.1-8B decode shapes: does the cost model pick well?

    python bench/nf4_gemv_tiles.py --out $OUT/nf4_gemv_tiles.json

For q/k/v (three members, 6144 x 4096), o (4096 x 4096), gate/up (two members, 28672 x 4096) and
down (4096 x 14336), at M = 1, 8 and 16 rows: every tile shape of a grid around the model's
candidates, the model's own choice (`choose_tiles`), and for reference bitsandbytes (its 4-bit
GEMV at one row, dequantize + GEMM above; one call per member) and the bf16 product over the
dequantized weight (`kestrel.kernels.decode.gemv.linear`). Kernel time only: R launches over R copies of the
weight (more bytes than L2 holds, so none is read from it) captured in one CUDA graph, replayed;
time per launch = replay time / R. GB/s counts the bytes the kernel reads of the weight
(packed + fp32 absmax). The kernels are compiled first in parallel worker processes (Triton's
on-disk cache), then timed one by one in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kestrel.kernels.decode.nf4_gemv import MAX_ROWS, Tiles, choose_tiles, nf4_gemv, nf4_weight, tile_cost  # noqa: E402

SHAPES = {"qkv": ((4096, 1024, 1024), 4096), "o": ((4096,), 4096), "gate_up": ((14336, 14336), 4096),
          "down": ((4096,), 14336)}
ROWS = (1, 8, 16)
ROTATE_BYTES = 256 << 20  # weight copies per graph: past the 50 MB L2 several times over


def candidates(m: int, k: int) -> list[Tiles]:
    """The grid swept at m rows: around what `choose_tiles` considers, with 2 and 8 warps too
    (16 rows: the model's choice only, it is no speed target)."""
    out = []
    if m == 1:
        for bn in (1, 2, 4, 8):
            for bk in (512, 1024, 2048):
                for warps in (2, 4):
                    if 16 * 32 * warps <= bn * bk <= 64 * 32 * warps:
                        out.append(Tiles(1, bn, bk, 1, warps))
    if m == MAX_ROWS:
        return out
    for bn in (16, 32, 64, 128):
        for bk in (64, 128, 256):
            for split in (1, 2, 4, 8, 16):
                for warps in (4, 8):
                    low = 16 * 32 * warps if warps == 4 else 64 * 32 * 4
                    if not low <= bn * bk <= 64 * 32 * warps or k // bk < 2 * split:
                        continue
                    if m == 1 and (warps == 8 or bk != 128 or split > 8):
                        continue
                    out.append(Tiles(MAX_ROWS, bn, bk, split, warps))
    return out


def make_weight(sizes: tuple[int, ...], k: int, seed: int = 0):
    import bitsandbytes.functional as bnbf

    gen = torch.Generator(device="cuda").manual_seed(seed)
    members = []
    for n in sizes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        packed, state = bnbf.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
        members.append((packed, state, None))
    return nf4_weight(members, torch.bfloat16), members


def _compile(tasks: list[tuple[str, int, Tiles]]) -> int:
    """Worker: run each (shape, m, tiles) once, which compiles it into Triton's disk cache."""
    weights = {}
    for name, m, t in tasks:
        if name not in weights:
            weights[name] = make_weight(*SHAPES[name])[0]
        w = weights[name]
        try:
            nf4_gemv(torch.randn(m, w.k, device="cuda", dtype=torch.bfloat16), w, t)
        except Exception:  # noqa: BLE001 - reported when timed
            pass
    torch.cuda.synchronize()
    return len(tasks)


def graph_time_us(fns: list) -> float:
    """Microseconds per call of each of `fns` (one call each per replay), CUDA-graph replayed."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(fns)


def sweep_shape(name: str, sms: int) -> list[dict]:
    import bitsandbytes as bnb
    from kestrel.kernels.decode.gemv import linear

    sizes, k = SHAPES[name]
    first, members = make_weight(sizes, k)
    copies = max(2, ROTATE_BYTES // first.nbytes)
    weights = [first] + [make_weight(sizes, k, seed=i + 1)[0] for i in range(copies - 1)]
    dense = torch.cat([bnb.functional.dequantize_4bit(p, s) for p, s, _ in members])
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        chosen = choose_tiles(m, first.n, k, 64, sms)
        row = {"shape": name, "n": first.n, "k": k, "m": m, "weight_MB": first.nbytes / 1e6, "tiles": {}}
        for t in dict.fromkeys([chosen, chosen._replace(stages=3)] + candidates(m, k)):
            try:
                us = graph_time_us([lambda w=w, t=t: nf4_gemv(x, w, t) for w in weights])
            except Exception as exc:  # noqa: BLE001 - a tile that fails to compile or run is recorded
                row["tiles"][str(tuple(t))] = f"error: {type(exc).__name__}: {exc}"[:300]
                continue
            row["tiles"][str(tuple(t))] = {"us": us, "GBps": first.nbytes / us / 1e3,
                                           "model_cost": tile_cost(t, m, first.n, k, sms)}
        timed = {key: v for key, v in row["tiles"].items() if isinstance(v, dict)}
        best = min(timed, key=lambda key: timed[key]["us"])
        row["chosen"], row["chosen_us"] = str(tuple(chosen)), timed[str(tuple(chosen))]["us"]
        row["best"], row["best_us"] = best, timed[best]["us"]
        row["chosen_GBps"] = first.nbytes / row["chosen_us"] / 1e3
        # What Linear4bit.forward calls, per member: the 4-bit GEMV at one row, else dequantize + GEMM.
        row["bnb_us"] = graph_time_us([lambda: [bnb.matmul_4bit(x, p.t(), quant_state=s) for p, s, _ in members]])
        row["bf16_dequantized_us"] = graph_time_us([lambda: linear(x, dense)])
        print(f"{name:8s} m={m:2d}  chosen {row['chosen']} {row['chosen_us']:7.1f} us "
              f"({row['chosen_GBps']:6.0f} GB/s)  best {best} {row['best_us']:7.1f} us  bnb {row['bnb_us']:7.1f}  "
              f"bf16 {row['bf16_dequantized_us']:7.1f}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    args = p.parse_args()
    os.environ["KESTREL_KERNELS"] = "triton"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    names = args.shapes.split(",")
    tasks = []
    for name in names:
        sizes, k = SHAPES[name]
        for m in ROWS:
            chosen = choose_tiles(m, sum(sizes), k, 64, sms)
            tasks += [(name, m, t) for t in dict.fromkeys([chosen, chosen._replace(stages=3)] + candidates(m, k))]
    chunks = [tasks[i :: args.workers] for i in range(args.workers)]
    ctx = __import__("multiprocessing").get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        print(f"compiled {sum(pool.map(_compile, chunks))} kernels", flush=True)
    rows = [r for name in names for r in sweep_shape(name, sms)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "sms": sms, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
