"""Where a training step's time goes: GPU kernel time by kind, and GPU idle time by its cause.

    python bench/profile_train.py --impl kestrel --method qlora --out prof.txt [--trace t.json]

Runs --warmup steps (3), then profiles --steps (2). Reports, per step:
- wall time, GPU busy time (union of kernel intervals) and the idle rest;
- kernel time and launch count by kind (matrix products, NF4 dequantization, attention, loss,
  norms/RoPE/GLU, copies, other), from the kernels' names;
- the idle gaps (>= 20 us) summed by the op and the Python frames of ours (kestrel/, bench/) that
  launched the kernel which ended the gap: what the host was doing while the GPU waited.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.train import add_model_args, warmed_step  # noqa: E402

KINDS = [  # (kind, pattern over the lower-cased kernel name); first match wins
    ("dequant", r"dequant|nf4|kgemm_4bit"),
    ("attention", r"flash|fmha|attention|attn"),
    ("loss", r"cross_entropy|_ce_|logsumexp|flce"),
    ("matmul", r"gemm|gemv|cutlass|xmma|nvjet|matmul|sm90|sm100"),
    ("copy", r"memcpy|memset|copy|cat_|fill"),
    ("triton", r"triton|_kernel$"),
]
GAP_US = 20.0


def kind_of(name: str, launch: dict | None = None) -> str:
    """The kernel's kind by its name; one no pattern names is Triton's when it was launched through
    the driver API (`launch` a "cuda_driver" event: Triton's launcher calls cuLaunchKernel), as
    flash-linear-attention's `chunk_fwd_kernel_o` is, else "other" (PyTorch's elementwise kernels)."""
    low = name.lower()
    kind = next((k for k, pat in KINDS if re.search(pat, low)), None)
    if kind is None:
        kind = "triton" if launch is not None and launch.get("cat") == "cuda_driver" else "other"
    return kind


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _ours(frame: str) -> bool:
    return ("kestrel/" in frame or "bench/" in frame) and not any(
        skip in frame for skip in ("profile_train", "step_profile", "bench/dpo", "bench/common"))


def analyse(trace: dict, steps: int) -> str:
    events = trace["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    for k in kernels:  # each kernel's kind, once
        k["kind"] = kind_of(k["name"], launches.get(k.get("args", {}).get("correlation")))
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "python_function") and "dur" in e]
    cpu.sort(key=lambda e: e["ts"])
    kernels.sort(key=lambda e: e["ts"])
    lines = []
    start, end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
    busy = merge([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    busy_us = sum(e - s for s, e in busy)
    lines.append(f"per step: GPU span {(end - start) / steps / 1e3:.1f} ms, busy {busy_us / steps / 1e3:.1f} ms, "
                 f"idle {(end - start - busy_us) / steps / 1e3:.1f} ms, kernels {len(kernels) / steps:.0f}")
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_kind[e["kind"]][0] += e["dur"]
        by_kind[e["kind"]][1] += 1
        by_name[e["name"][:90]][0] += e["dur"]
        by_name[e["name"][:90]][1] += 1
    lines.append("\nkernel time by kind (ms/step, launches/step):")
    for k, (t, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {k:10s} {t / steps / 1e3:8.2f} ms  {n / steps:6.0f}")
    lines.append("\ntop kernels (ms/step, launches/step):")
    for k, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:30]:
        lines.append(f"  {t / steps / 1e3:8.2f} {n / steps:6.0f}  {k}")
    lines.append(f"\nGPU idle gaps >= {GAP_US:.0f} us by what launched the kernel after the gap (ms/step, count/step):")
    queries = []  # (launch ts, launch tid, gap us)
    starts = [k["ts"] for k in kernels]
    for (_, e0), (s1, _) in zip(busy, busy[1:]):
        if s1 - e0 >= GAP_US:
            nxt = kernels[min(bisect.bisect_left(starts, s1), len(kernels) - 1)]
            queries.append(_launched(nxt, launches, s1 - e0))
    gaps: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for where, gap in zip(_frames_at(cpu, queries), (q[2] for q in queries)):
        gaps[where][0] += gap
        gaps[where][1] += 1
    for k, (t, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:25]:
        lines.append(f"  {t / steps / 1e3:8.2f} {n / steps:6.1f}  {k}")
    lines += _gaps_in_step(busy, kernels, queries, cpu, start, (end - start) / steps)
    lines += _copy_only(kernels, launches, cpu, start, (end - start) / steps, steps)
    lines += _host_waits(events, cpu, steps)
    lines += _kernels_by_source(kernels, launches, cpu, steps, ("other", "copy"))
    lines += _products_by_shape(kernels, cpu, steps)
    return "\n".join(lines)


def _host_copy(kernel: dict) -> bool:
    """A copy between host and device memory (offloaded checkpointing's pages), which the side stream runs."""
    return kernel.get("cat") == "gpu_memcpy" and ("HtoD" in kernel["name"] or "DtoH" in kernel["name"])


def _copy_only(kernels: list[dict], launches: dict, cpu: list[dict], start: float, step_us: float, steps: int,
               top: int = 12) -> list[str]:
    """Time in which host copies run and no other kernel does: the GPU's compute waiting for pages (a layer's
    copy back not in yet, or the compute stream told to wait for a copy out). The "busy" figure counts it as
    busy. Summed, then the longest such intervals with where in the step each fell and what launched the
    compute kernel after it."""
    compute = merge([(k["ts"], k["ts"] + k["dur"]) for k in kernels if not _host_copy(k)])
    copies = merge([(k["ts"], k["ts"] + k["dur"]) for k in kernels if _host_copy(k)])
    alone: list[tuple[float, float]] = []  # copies minus compute
    i = 0
    for s, e in copies:
        while i < len(compute) and compute[i][1] <= s:
            i += 1
        j, at = i, s
        while j < len(compute) and compute[j][0] < e:
            if compute[j][0] > at:
                alone.append((at, compute[j][0]))
            at = max(at, compute[j][1])
            j += 1
        if at < e:
            alone.append((at, e))
    total = sum(e - s for s, e in alone)
    lines = [f"\ncompute idle while only host copies run: {total / steps / 1e3:.2f} ms a step (counted busy above)"
             + (":" if alone else "")]
    computing = [k for k in kernels if not _host_copy(k)]
    starts = [k["ts"] for k in computing]
    longest = sorted(alone, key=lambda iv: iv[0] - iv[1])[:top]
    after = [computing[min(bisect.bisect_left(starts, e), len(computing) - 1)] for _, e in longest] if computing else []
    queries = [_launched(k, launches, e - s) for k, (s, e) in zip(after, longest)]
    for (s, e), what in zip(longest, _frames_at(cpu, queries)):
        lines.append(f"  {e - s:8.0f} {((s - start) % step_us) / 1e3:8.1f}  {what}")
    return lines


# CUDA runtime calls in which the host waits for the GPU: after one, the GPU idles while the host launches again
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _host_waits(events: list[dict], cpu: list[dict], steps: int) -> list[str]:
    """The host's waits for the GPU (`WAITS`: a synchronize, a blocking copy) by the op and our frames that made them:
    time and count a step. A step that waits nowhere keeps the host ahead, and the GPU never idles for its launches."""
    waits = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") in WAITS and "dur" in e]
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for where, e in zip(_frames_at(cpu, [(e["ts"], e.get("tid"), e["dur"]) for e in waits]), waits):
        rows[f"{e['name']}: {where}"][0] += e["dur"]
        rows[f"{e['name']}: {where}"][1] += 1
    lines = ["\nhost waits for the GPU by call, op and our frames (ms/step, count/step)"
             + ("; none" if not rows else ":")]
    for k, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:20]:
        lines.append(f"  {t / steps / 1e3:8.2f} {n / steps:6.1f}  {k}")
    return lines


def _gaps_in_step(busy: list[tuple[float, float]], kernels: list[dict], queries: list[tuple], cpu: list[dict],
                  start: float, step_us: float, top: int = 12) -> list[str]:
    """The longest idle gaps with where in its step each fell (ms from the step's start, the profiled steps taken
    as equal spans from the first kernel) and what launched the kernel after it; and where each step's first
    loss kernel ran, the turn from forward to backward (a wait for pages just after it is the top layer's)."""
    gaps = [(s1 - e0, e0) for (_, e0), (s1, _) in zip(busy, busy[1:]) if s1 - e0 >= GAP_US]  # as `queries`, in order
    named = [(gap, at, what) for (gap, at), what in zip(gaps, _frames_at(cpu, queries))]
    loss = sorted({int((k["ts"] - start) // step_us): (k["ts"] - start) % step_us
                   for k in reversed(kernels) if k["kind"] == "loss"}.items())
    lines = ["\nlongest idle gaps (us, ms into the step, what launched the kernel after); the loss's first kernel at "
             + ", ".join(f"{at / 1e3:.1f} ms" for _, at in loss) + " into each step:"]
    for gap, at, what in sorted(named, key=lambda g: -g[0])[:top]:
        lines.append(f"  {gap:8.0f} {((at - start) % step_us) / 1e3:8.1f}  {what}")
    return lines


def _kernels_by_source(kernels: list[dict], launches: dict, cpu: list[dict], steps: int,
                       kinds: tuple[str, ...]) -> list[str]:
    """The time of the kernels of `kinds` by the op and the frames of ours that launched them:
    elementwise kernels' names are cut before their functor, so the launching op (and the line of
    ours under it) says which of them a step could drop or fuse."""
    queries = [_launched(k, launches, k["dur"]) for k in kernels if k["kind"] in kinds]
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for where, (_, _, dur) in zip(_frames_at(cpu, queries), queries):
        rows[where][0] += dur
        rows[where][1] += 1
    lines = [f"\n{' and '.join(kinds)} kernels by the op and our frames that launched them (ms/step, launches/step):"]
    for k, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:30]:
        lines.append(f"  {t / steps / 1e3:8.2f} {n / steps:6.1f}  {k}")
    return lines


def _launched(kernel: dict, launches: dict, value: float) -> tuple:
    """(launch ts, launch thread, value) of `kernel`'s launch, for `_frames_at`; (None, None,
    value) when the trace lost the launch."""
    launch = launches.get(kernel["args"].get("correlation"))
    return (launch["ts"], launch.get("tid"), value) if launch else (None, None, value)


def _products_by_shape(kernels: list[dict], cpu: list[dict], steps: int) -> list[str]:
    """Matrix-product kernel time by (op, input shapes) with the achieved TFLOP/s (needs the
    profile's record_shapes): which products run below cuBLAS's rate, and how often."""
    ops = {e["args"]["External id"]: e for e in cpu
           if e.get("cat") == "cpu_op" and "External id" in e.get("args", {}) and "Input Dims" in e["args"]}
    rows: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    for k in kernels:
        if k["kind"] != "matmul":
            continue
        op = ops.get(k["args"].get("External id"))
        dims = [d for d in (op["args"]["Input Dims"] if op else []) if len(d) == 2]
        key = (op["name"] if op else "?", tuple(tuple(d) for d in dims))
        rows[key][0] += k["dur"]
        rows[key][1] += 1
        rows[key][2] += _flops(*key)
    lines = ["\nmatrix products by op and 2-D input shapes (ms/step, launches/step, TFLOP/s):"]
    for (name, dims), (t, n, fl) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:40]:
        rate = f"{fl / t / 1e6:6.0f}" if fl and t else "     ?"
        lines.append(f"  {t / steps / 1e3:8.2f} {n / steps:6.0f} {rate}  {name} {list(dims)}")
    return lines


def _flops(name: str, dims: tuple) -> float:
    """2 M N K for mm / addmm (the last two 2-D inputs are the factors)."""
    if len(dims) < 2:
        return 0.0
    (m, k), (k2, n) = dims[-2], dims[-1]
    return 2.0 * m * n * k if k == k2 else 0.0


def _frames_at(cpu: list[dict], queries: list[tuple]) -> list[str]:
    """For each (ts, tid, _): the innermost frame of ours (else the innermost op) open at ts on
    that thread. One sweep over the host events (sorted by start), a stack of open ones per thread."""
    order = sorted(range(len(queries)), key=lambda i: queries[i][0] if queries[i][0] is not None else -1)
    out = ["?"] * len(queries)
    stacks: dict = defaultdict(list)
    j = 0
    for i in order:
        ts, tid, _ = queries[i]
        if ts is None:
            continue
        while j < len(cpu) and cpu[j]["ts"] <= ts:
            e = cpu[j]
            st = stacks[e.get("tid")]
            while st and st[-1]["ts"] + st[-1]["dur"] < e["ts"]:
                st.pop()
            st.append(e)
            j += 1
        open_ = [e for e in stacks[tid] if e["ts"] + e["dur"] >= ts]
        ours = [e for e in open_ if e.get("cat") == "python_function" and _ours(e["name"])]
        op = next((e for e in reversed(open_) if e.get("cat") == "cpu_op"), None)
        where = " < ".join(_short(e["name"]) for e in reversed(ours[-2:]))  # innermost frame of ours, its caller
        out[i] = (f"{op['name']} in {where}" if op and where else where or (op["name"] if op else "?"))[-150:]
    return out


def _short(frame: str) -> str:
    """'…/kestrel/model/attention.py(183): fn' -> 'model/attention.py(183): fn'."""
    return re.sub(r"^.*?(kestrel|bench)/", "", frame)


def host_profile(step, steps: int) -> str:
    """cProfile over `steps` steps: the host functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    print(out.getvalue()[:6000], flush=True)
    return out.getvalue()


def host_slack(step, steps: int, head_ms: float = 150.0) -> str:
    """Whether the host holds the GPU back: each step timed (synchronised) as it is, then with the
    GPU given a head start (a sleep kernel of `head_ms` queued first, so the host can run ahead
    by up to the launch queue's depth). A GPU-bound step takes `head_ms` longer; a step whose GPU
    waits for the host somewhere takes less than that, by the waiting the head start hid."""
    probe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe[0].record()
    torch.cuda._sleep(100_000_000)
    probe[1].record()
    torch.cuda.synchronize()
    cycles = int(100_000_000 * head_ms / probe[0].elapsed_time(probe[1]))

    def timed(head: bool) -> float:
        total = 0.0
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if head:
                torch.cuda._sleep(cycles)
            step()
            torch.cuda.synchronize()
            total += time.perf_counter() - t0
        return total / steps * 1e3

    plain, ahead = timed(False), timed(True) - head_ms
    return (f"host slack over {steps} synchronised steps: {plain:.1f} ms a step as is, {ahead:.1f} ms "
            f"with a {head_ms:.0f} ms head start (minus it): the GPU waited {plain - ahead:.1f} ms for the host\n")


def phase_clocks(model: torch.nn.Module, step, steps: int) -> str:
    """When the host and the GPU reach each decoder layer's forward (pre-hook), timed from a
    synchronised step start: where the GPU is ahead (waiting for launches) and where behind."""
    marks: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((name, time.perf_counter(), ev))

    collections: list[tuple[int, float]] = []  # (generation, ms) of Python's cyclic GC runs
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            collections.append((info["generation"], (time.perf_counter() - started.pop()) * 1e3))

    gc.callbacks.append(on_gc)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    hooks = [m.register_forward_pre_hook(lambda mod, _a, i=i: mark(f"layer {i}")) for i, m in enumerate(layers)]
    lines = []
    try:
        for _ in range(steps):
            marks.clear()
            torch.cuda.synchronize()
            mark("start")
            step()
            mark("end")
            torch.cuda.synchronize()
            t0, e0 = marks[0][1], marks[0][2]
            rows = [(n, (t - t0) * 1e3, e0.elapsed_time(ev)) for n, t, ev in marks]
        lines.append("host and GPU clocks at marks of the last step (ms since its start; a mark reached"
                     " twice: first pass, then recompute):")
        lines += [f"  {n:10s} host {h:7.1f}  gpu {g:7.1f}  gpu-host {g - h:+7.1f}" for n, h, g in rows]
    finally:
        for h in hooks:
            h.remove()
        gc.callbacks.remove(on_gc)
    by_gen = {g: [t for gg, t in collections if gg == g] for g in sorted({g for g, _ in collections})}
    lines.append(f"Python GC over {steps} steps: " + ", ".join(
        f"gen{g} {len(ts)} runs {sum(ts):.1f} ms (max {max(ts):.1f})" for g, ts in by_gen.items()))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3, help="steps before the profiled ones (more let a run's "
                    "measured choices settle: keep_attention auto, the CUDA-graph chooser)")
    ap.add_argument("--stack", action="store_true", help="record Python frames (slower host)")
    ap.add_argument("--trace", default="")
    ap.add_argument("--host", action="store_true", help="cProfile the host side instead (where Python time goes)")
    ap.add_argument("--slack", type=int, default=0, help="also time this many steps with and without a GPU head start")
    ap.add_argument("--clocks", action="store_true", help="host vs GPU time at each decoder layer")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    step = warmed_step(args, args.warmup)
    slack = host_slack(step, args.slack) if args.slack else ""
    if args.clocks:
        slack += phase_clocks(step.model, step, 2)
    if args.host:
        Path(args.out).write_text(host_profile(step, args.steps))
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.stack, record_shapes=True) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    trace_path = args.trace or tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(trace_path)
    rows = f"the matrix's {args.layout} batches" if args.layout else f"b{args.batch} x {args.seq} ckpt={args.checkpointing}"
    report = f"{args.impl} {args.method} {rows}\n" + slack
    if args.impl == "kestrel":
        from kestrel.recompute.checkpoint import recompute_of

        run = recompute_of(step.model)
        report += f"decoder-layer CUDA graphs: {run.graphs.stats() if run else None}\n"
        if run is not None:  # what the run decided before the profiled steps: a profile reads differently with each
            report += (f"kept by row count (attention, projection, Q/K/V): "
                       f"{ {rows: (k.attention, k.projection, k.qkv) for rows, k in run.kept.items()} }; host link "
                       f"{ {str(d): round(r / 1e9, 1) for d, r in run.deferral.link.rates.items() if r} } GB/s, first "
                       f"pass ms { {rows: round(t * 1e3, 2) for rows, t in run.deferral.link.layer_seconds.items()} }\n")
            report += "".join(f"graph choice {d.layout}: {'graphed' if d.graphed else 'eager'} ({d.reason})\n"
                              for d in run.chooser.decisions())  # none where graphs are forced
    report += analyse(json.loads(Path(trace_path).read_text()), args.steps)
    Path(args.out).write_text(report)
    print(report, flush=True)


if __name__ == "__main__":
    main()
