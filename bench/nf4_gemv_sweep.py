"""Check, time and choose the tiles of kernels/decode/nf4_gemv.py at the Llama-3.1-8B decode shapes.

    python bench/nf4_gemv_sweep.py --out $OUT/nf4_gemv_sweep.json      # ~3-5 min on an H100, before phase 4

For q/k/v (three members, 6144 x 4096), o (4096 x 4096), gate/up (two members, 28672 x 4096) and
down (4096 x 14336), at M = 1, 2, 8 and 16 rows:
  1. every candidate of a grid (`candidates`: one-row multiply-adds at 1 row, tensor cores at
     1-16, split-K on both, each with the byte-pair lookup and with the gather-free register
     table, PRMT) and the cost model's tiles with each lookup (`nf4_tiles.choose_tiles`; NIBBLE
     with one split at one row is the session-15 kernel's decoding) is checked against
     bitsandbytes' CUDA dequantize: one-hot rows of x must return its values bit for bit, random
     rows its fp64 product within bf16 rounding. A candidate that fails (to compile, to run, or
     the check) is recorded and never chosen; one that failed in a compile worker is not run in
     this process again (a kernel that faults would leave its CUDA context unusable);
  2. each checked candidate is timed: R launches over R copies of the weight (more bytes than L2
     holds) captured in one CUDA graph, replayed; GB/s counts the bytes the kernel reads (packed
     nibbles, fp32 absmax), `of_copy` divides that by the copy bandwidth (read + write of 1 GiB);
  3. bitsandbytes as Linear4bit.forward calls it (its 4-bit GEMV at one row, dequantize + GEMM
     above; one call per member) is timed the same way;
  4. a second phase: the `variants` of each row count's REFINE_TOP fastest PRMT candidates (each
     block loaded in two parts, loads pipelined over stages, at one row the rows in two groups;
     `nf4_gemv.py`'s docstring says what each does) are compiled the same way, checked and timed;
  5. the fastest checked candidate per row count (its lookup included), and whether it beats
     bitsandbytes at one row, is the shape's plan: written into the table the decode path reads
     (`kestrel/kernels/decode/nf4_gemv_tiles.json`, keyed by device name and (N, K)) and copied
     beside --out. bench/nf4_decode.py run afterwards on the same machine uses it.
The kernels are compiled first in parallel worker processes (Triton's on-disk cache), then
checked and timed one by one in this process. Session 15's measurements of the first kernel
(bench/results/nf4-gemv-tiles-2026-11-25-h100.json) are printed beside, for the same card.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import copy_bandwidth  # noqa: E402
from kestrel.kernels._utils import cdiv  # noqa: E402
from kestrel.kernels.decode import nf4_tiles  # noqa: E402
from kestrel.kernels.decode.nf4_gemv import (  # noqa: E402
    MAX_ROWS, NIBBLE, PAIR, PRMT, NF4Weight, Tiles, nf4_gemv, nf4_weight,
)

SHAPES = {"qkv": ((4096, 1024, 1024), 4096), "o": ((4096,), 4096), "gate_up": ((14336, 14336), 4096),
          "down": ((4096,), 14336)}
ROWS = (1, 2, 8, 16)
LOOKUPS = {NIBBLE: "nibble", PAIR: "pair", PRMT: "prmt"}
ROTATE_BYTES = 256 << 20  # weight copies per graph: past the 50 MB L2 several times over
SESSION_15 = ROOT / "bench" / "results" / "nf4-gemv-tiles-2026-11-25-h100.json"
REFINE_TOP = 6  # the fastest PRMT tiles per shape and row count that the second phase varies
PARTS, STAGES = (1, 2), (1, 2, 3)  # the second phase's variants: block parts, pipelined stages (`variants`)


def candidates(one_row: bool, n: int, k: int, sms: int) -> list[Tiles]:
    """The grid: 8-64 decoded values a thread a step, with and without prefetch, the PAIR and PRMT
    lookups; split-K only where the row tiles alone give fewer than 4 programs an SM, and at most 8
    programs an SM with it."""
    if one_row:
        rows, widths, warp_counts, block_m = (2, 4, 8, 16), (256, 512, 1024), (2, 4), 1
    else:
        rows, widths, warp_counts, block_m = (16, 32, 64), (64, 128, 256), (4,), MAX_ROWS
    out = []
    for block_n in rows:
        for block_k in widths:
            for warps in warp_counts:
                if not 8 <= block_n * block_k // (32 * warps) <= 64 or block_k > k:
                    continue
                tiles = cdiv(n, block_n)
                for split in (1, 2, 4, 8):
                    if split == 1 or (tiles < 4 * sms and tiles * split <= 8 * sms and cdiv(k, block_k) >= 2 * split):
                        out += [Tiles(block_m, block_n, block_k, split, warps, lookup=lookup, prefetch=p)
                                for lookup in (PAIR, PRMT) for p in (False, True)]
    return out


def shape_tasks(name: str, sms: int) -> list[tuple[int, Tiles]]:
    """(rows to time at, tiles) for one shape: the one-row grid (at 1) and the tensor-core grid (0:
    at every count, one compiled kernel), the cost model's tiles with each lookup (at their m)."""
    sizes, k = SHAPES[name]
    n = sum(sizes)
    tasks = [(1, t) for t in candidates(True, n, k, sms)] + [(0, t) for t in candidates(False, n, k, sms)]
    for m in ROWS:
        model = nf4_tiles.choose_tiles(m, n, k, 64, sms)
        tasks += [(m, model), (m, session_15_tiles(model)), (m, model._replace(lookup=PRMT))]
    return list(dict.fromkeys(tasks))


def session_15_tiles(model: Tiles) -> Tiles:
    """The first kernel's decoding at the model's tiles: nibble lookups, no split-K at one row."""
    return model._replace(lookup=NIBBLE, split=1) if model.block_m == 1 else model._replace(lookup=NIBBLE)


def refinements(timed: dict[Tiles, float], top: int = REFINE_TOP) -> list[Tiles]:
    """The second phase's candidates at one row count: the `variants` of the `top` fastest PRMT
    tiles of the first (`timed`: microseconds of each checked candidate), less those already timed.
    Varying these knobs around the best tiles, not over the whole grid, keeps the sweep within one
    device call."""
    best = sorted((t for t in timed if t.lookup == PRMT), key=lambda t: timed[t])[:top]
    return [t for t in dict.fromkeys(v for b in best for v in variants(b)) if t not in timed]


def variants(t: Tiles) -> list[Tiles]:
    """`t` with its blocks loaded in one and two parts and its loads pipelined over 1-3 stages; at
    one row also with its rows in two groups (no register prefetch then), at its row tile and at
    twice it (a group then keeps the rows a thread held)."""
    out = [t._replace(parts=p, stages=s) for p in PARTS for s in STAGES]
    if t.block_m == 1:
        out += [t._replace(block_n=n, parts=p, stages=s, groups=2, prefetch=False)
                for n in (t.block_n, 2 * t.block_n) for p in PARTS for s in STAGES]
    return list(dict.fromkeys(out))


def make_weight(sizes: tuple[int, ...], k: int, seed: int = 0) -> tuple[NF4Weight, list]:
    import bitsandbytes.functional as bnbf

    gen = torch.Generator(device="cuda").manual_seed(seed)
    members = []
    for n in sizes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        packed, state = bnbf.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
        members.append((packed, state, None))
    return nf4_weight(members, torch.bfloat16), members


def _compile(tasks: list[tuple[str, Tiles]]) -> list[str]:
    """Worker: run each (shape, tiles) once, which compiles it into Triton's disk cache; per task ""
    or the error it raised. Once an error leaves this process's CUDA context unusable, the tasks
    left with the failed one's lookup are reported failed too, the others "" (the sweep runs them)."""
    os.environ["KESTREL_KERNELS"] = "triton"
    weights: dict[str, NF4Weight] = {}
    out: list[str] = []
    broken: tuple[int, str] | None = None  # (lookup, error) that broke the context
    for name, t in tasks:
        if broken is not None:
            out.append(f"not run: a {LOOKUPS[broken[0]]} candidate broke a compile worker ({broken[1]})"[:300]
                       if t.lookup == broken[0] else "")
            continue
        try:
            _run_once(name, t, weights)
            out.append("")
        except Exception as exc:  # noqa: BLE001 - reported as the candidate's problem
            out.append(f"error in a compile worker: {type(exc).__name__}: {exc}"[:300])
            if not _cuda_alive():
                broken = (t.lookup, f"{type(exc).__name__}: {exc}"[:120])
    return out


def _run_once(name: str, t: Tiles, weights: dict[str, NF4Weight]) -> None:
    """One launch of tiles `t` on shape `name` (its weight built once into `weights`), waited for."""
    if name not in weights:
        weights[name] = make_weight(*SHAPES[name])[0]
    w = weights[name]
    nf4_gemv(torch.randn(1 if t.block_m == 1 else 2, w.k, device="cuda", dtype=torch.bfloat16), w, t)
    torch.cuda.synchronize()  # a fault shows here, at its own task


def _cuda_alive() -> bool:
    """False once a fault has left this process's CUDA context unusable."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return False
    return True


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


class Checker:
    """The reference for one weight at m rows: bitsandbytes' dequantized values (bf16) and the
    fp64 product of random rows; `problem(tiles)` is "" when the kernel reproduces both."""

    def __init__(self, weight: NF4Weight, w16: torch.Tensor, m: int):
        self.weight, self.w16, self.m = weight, w16, m
        gen = torch.Generator(device="cuda").manual_seed(m)
        self.x = torch.randn(m, weight.k, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.ref = self.x.double() @ w16.double().T
        self.cols = torch.randint(0, weight.k, (m,), device="cuda", generator=gen)
        self.hot = torch.zeros(m, weight.k, device="cuda", dtype=torch.bfloat16)
        self.hot[torch.arange(m, device="cuda"), self.cols] = 1.0

    def problem(self, t: Tiles, worker_error: str = "") -> str:
        if worker_error:
            return worker_error
        if t.lookup == PRMT and not self.weight.register_table:
            return "the PRMT lookup cannot read this weight (it would run NIBBLE)"
        try:
            hot = nf4_gemv(self.hot, self.weight, t)
            y = nf4_gemv(self.x, self.weight, t).double()
        except Exception as exc:  # noqa: BLE001 - a candidate that fails to compile or run is recorded
            return f"error: {type(exc).__name__}: {exc}"[:300]
        if not torch.equal(hot, self.w16[:, self.cols].T):
            return "values differ from bitsandbytes' dequantize"
        # bf16 output: at most half an ulp of each value (2^-8 relative), twice that for room, plus
        # the fp32 summation order over K (far below 2^-11 of the largest value).
        tol = 2**-7 * self.ref.abs() + 2**-11 * float(self.ref.abs().max())
        if not bool(((y - self.ref).abs() <= tol).all()) or bool(self.weight.tickets.any()):
            return f"product off by {float((y - self.ref).abs().max()):.3g} (or split-K tickets left set)"
        return ""


def sweep_shape(name: str, sms: int, bandwidth: float, old: dict, errors: dict[tuple[str, Tiles], str],
                workers: int) -> tuple[list[dict], nf4_tiles.Plan]:
    """Check and time every task of one shape at each row count (`errors`: the compile workers'),
    then the refinements of the fastest (`refinements`, compiled in `workers` processes first)."""
    import bitsandbytes as bnb

    sizes, k = SHAPES[name]
    first, members = make_weight(sizes, k)
    copies = max(2, ROTATE_BYTES // first.nbytes)
    built = [(first, members)] + [make_weight(sizes, k, seed=i + 1) for i in range(copies - 1)]
    weights = [w for w, _ in built]
    w16 = torch.cat([bnb.functional.dequantize_4bit(p, s) for p, s, _ in members])
    checks = {m: Checker(first, w16, m) for m in ROWS}
    rows = {m: {"shape": name, "n": first.n, "k": k, "m": m, "weight_MB": first.nbytes / 1e6, "tiles": {}} for m in ROWS}
    timed: dict[int, dict[Tiles, float]] = {m: {} for m in ROWS}
    tasks = shape_tasks(name, sms)
    for m in ROWS:
        grid = [t for at, t in tasks if at in (m, 0) and not (t.block_m == 1 and m > 1)]
        _time_tasks(name, grid, checks[m], weights, errors, rows[m], timed[m], bandwidth)
    refined = list(dict.fromkeys(t for m in ROWS for t in refinements(timed[m])))
    errors.update(compile_tasks([(name, t) for t in refined], workers))
    for m in ROWS:
        more = [t for t in refined if (m == 1 or t.block_m > 1) and t not in timed[m]]
        _time_tasks(name, more, checks[m], weights, errors, rows[m], timed[m], bandwidth)
    chosen = []
    for m in ROWS:
        x = checks[m].x
        # What Linear4bit.forward calls, per member: the 4-bit GEMV at one row, else dequantize + GEMM
        # (over the same copies: no weight read from L2).
        rows[m]["bnb_us"] = graph_time_us([lambda mb=mb: [bnb.matmul_4bit(x, p.t(), quant_state=s) for p, s, _ in mb]
                                           for _, mb in built])
        best = min(timed[m], key=timed[m].get) if timed[m] else None
        summarize(rows[m], best, nf4_tiles.choose_tiles(m, first.n, k, 64, sms), old.get((name, m)))
        chosen.append((m, best))
    plan = nf4_tiles.Plan(tuple((m, t) for m, t in chosen if t is not None),
                          kernel_one_row=bool(rows[1].get("best_us", float("inf")) < rows[1]["bnb_us"]))
    return [rows[m] for m in ROWS], plan


def _time_tasks(name: str, tiles: list[Tiles], check: Checker, weights: list[NF4Weight],
                errors: dict[tuple[str, Tiles], str], row: dict, timed: dict[Tiles, float], bandwidth: float) -> None:
    """Check each of `tiles` at `check`'s row count and time those that pass, into `row` and `timed`."""
    first, x = weights[0], check.x
    for t in tiles:
        entry = {"lookup": LOOKUPS[t.lookup], "problem": check.problem(t, errors.get((name, t), ""))}
        if not entry["problem"]:
            try:
                us = graph_time_us([lambda w=w, t=t: nf4_gemv(x, w, t) for w in weights])
            except Exception as exc:  # noqa: BLE001 - recorded, never chosen
                entry["problem"] = f"timing failed: {type(exc).__name__}: {exc}"[:300]
            else:
                timed[t] = entry["us"] = us
                entry["GBps"] = first.nbytes / us / 1e3
                entry["of_copy"] = entry["GBps"] * 1e9 / bandwidth
        row["tiles"][str(tuple(t))] = entry


def summarize(row: dict, best: Tiles | None, model: Tiles, old: dict | None) -> None:
    """Best checked tiles, the model's with each lookup, the best of each lookup, bitsandbytes,
    session 15; one line printed (and per lookup the count of failed candidates and one's problem)."""
    failed = {key: v for key, v in row["tiles"].items() if v["problem"]}
    row["failed"] = len(failed)
    row["failed_by_lookup"] = {name: sum(v["lookup"] == name for v in failed.values()) for name in LOOKUPS.values()}
    for name, count in row["failed_by_lookup"].items():
        if count:
            key, v = next((key, v) for key, v in failed.items() if v["lookup"] == name)
            print(f"  {row['shape']} m={row['m']}: {count} {name} candidates failed, e.g. {key}: {v['problem']}",
                  flush=True)
    if best is None:
        return
    got = row["tiles"][str(tuple(best))]
    row.update(best=str(tuple(best)), best_us=got["us"], best_GBps=got["GBps"], best_of_copy=got["of_copy"])
    for label, t in (("model", model), ("model_nibble", session_15_tiles(model)), ("model_prmt", model._replace(lookup=PRMT))):
        row[f"{label}_us"] = row["tiles"].get(str(tuple(t)), {}).get("us")
    row["best_us_by_lookup"] = {name: min((v["us"] for v in row["tiles"].values() if "us" in v and v["lookup"] == name),
                                          default=None) for name in LOOKUPS.values()}
    row["bnb_GBps"] = row["weight_MB"] / row["bnb_us"] * 1e3  # our bytes over its time (it reads uint8 absmax)
    row["session15_us"] = old
    old_text = f"{old['best_us']:6.1f} (bnb then {old['bnb_us']:5.1f})" if old else "n/a"
    print(f"{row['shape']:8s} m={row['m']:2d} best {row['best']} {row['best_us']:7.1f} us {row['best_GBps']:6.0f} GB/s "
          f"({row['best_of_copy']:.0%} of copy) | model tiles {fmt(row['model_us'])} | session-15 decoding "
          f"{fmt(row['model_nibble_us'])} | best by lookup "
          + " ".join(f"{name} {fmt(us)}" for name, us in row["best_us_by_lookup"].items())
          + f" | bnb {row['bnb_us']:6.1f} | session 15 best {old_text}", flush=True)


def fmt(us: float | None) -> str:
    return f"{us:6.1f}" if us is not None else "  n/a "


def session_15(device: str) -> dict:
    """{(shape, m): {best_us, bnb_us}} from session 15's sweep of the first kernel, same device only."""
    if not SESSION_15.exists():
        return {}
    data = json.loads(SESSION_15.read_text())
    if data.get("device") != device:
        return {}
    return {(r["shape"], r["m"]): {"best_us": r["best_us"], "bnb_us": r["bnb_us"]} for r in data["rows"]}


def compile_all(names: list[str], sms: int, workers: int) -> dict[tuple[str, Tiles], str]:
    """Compile every grid task of `names` (`compile_tasks`)."""
    return compile_tasks([(name, t) for name in names for t in dict.fromkeys(t for _, t in shape_tasks(name, sms))],
                         workers)


def compile_tasks(tasks: list[tuple[str, Tiles]], workers: int) -> dict[tuple[str, Tiles], str]:
    """Compile `tasks` in `workers` processes; {(shape, tiles): error} of those that failed there.
    A worker that dies takes its PRMT tasks (the inline PTX: the likeliest cause) with it as failed;
    its other tasks are compiled by the sweep itself."""
    if not tasks:
        return {}
    start = time.perf_counter()
    chunks = [c for c in (tasks[i::workers] for i in range(workers)) if c]
    ctx = __import__("multiprocessing").get_context("spawn")
    results = []
    with ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
        for chunk, future in [(chunk, pool.submit(_compile, chunk)) for chunk in chunks]:
            try:
                results.append(future.result())
            except Exception as exc:  # noqa: BLE001 - a dead worker (BrokenProcessPool) must not end the sweep
                died = f"not run: its compile worker died ({type(exc).__name__}: {exc})"[:300]
                results.append([died if t.lookup == PRMT else "" for _, t in chunk])
    errors = {task: err for chunk, got in zip(chunks, results) for task, err in zip(chunk, got) if err}
    print(f"compiled {len(tasks)} kernels in {time.perf_counter() - start:.0f} s ({len(errors)} failed)", flush=True)
    return errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)))
    p.add_argument("--no-store", action="store_true", help="do not write the plans into the decode path's table")
    args = p.parse_args()
    os.environ["KESTREL_KERNELS"] = "triton"
    start = time.perf_counter()
    device = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = copy_bandwidth(torch.device("cuda"))
    names = args.shapes.split(",")
    print(f"{device}: {sms} SMs, copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    errors = compile_all(names, sms, args.workers)
    old = session_15(device)
    rows, plans = [], {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in names:  # each shape's plan and the report so far are written as soon as it is done
        shape_rows, plan = sweep_shape(name, sms, bandwidth, old, errors, args.workers)
        rows += shape_rows
        plans[name] = plan
        if not args.no_store:
            nf4_tiles.store_plan(device, shape_rows[0]["n"], shape_rows[0]["k"], plan)
            (args.out.parent / nf4_tiles.TABLE.name).write_text(nf4_tiles.TABLE.read_text())
        report = {"device": device, "sms": sms, "copy_bandwidth_GBps": bandwidth / 1e9, "rows": rows,
                  "plans": {name: {"tiles": {m: list(t) for m, t in plan.tiles}, "kernel_one_row": plan.kernel_one_row}
                            for name, plan in plans.items()},
                  "wall_s": round(time.perf_counter() - start, 1)}
        args.out.write_text(json.dumps(report, indent=1))
    for name, plan in plans.items():
        print(f"plan {name}: kernel at one row {plan.kernel_one_row}; " + ", ".join(f"m={m} {tuple(t)}" for m, t in plan.tiles))
    print(f"wrote {args.out} in {report['wall_s']} s")


if __name__ == "__main__":
    main()
