"""What is alive on the GPU at a training step's memory peak, and who allocated it.

    python bench/memory_peak.py --impl kestrel --out peak.txt [--checkpointing offload] [--reserved]

Runs two warm-up steps, then records one step with torch's CUDA allocator history
(`torch.cuda.memory._record_memory_history`). Replays the allocation events to find the moment
the allocated bytes peak, and reports the blocks alive then that were allocated during the step,
grouped by the innermost frame of ours (kestrel/, bench/) or else the innermost frame,
plus the baseline allocated before the step (weights, optimizer state, workspaces).

`--reserved` records from before the model is built through the third step (no warm-up: CUDA
graphs are captured in the second), and finds the moment the reserved bytes (the allocator's
segments, which is what the GPU holds) peak instead: reserved and allocated by stream then, the
blocks alive by site, and what asked for the segment that made the peak. It ends with the
segments by memory pool (a CUDA graphs' private pool apart from the default one).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.train import add_model_args, warmed_step  # noqa: E402
from kestrel.recompute.checkpoint import recompute_of  # noqa: E402

_OURS = ("/kestrel/", "/bench/")


def _site(frames: list[dict]) -> str:
    """The innermost frame in our code, else the innermost Python frame, as file:line fn."""
    py = [f for f in frames if f["filename"].endswith(".py")]
    pick = next((f for f in py if any(s in f["filename"] for s in _OURS)), py[0] if py else None)
    if pick is None:
        return "?"
    return f"{'/'.join(pick['filename'].split('/')[-2:])}:{pick['line']} {pick['name']}"


def _by_site(blocks: list[tuple[int, str]], top: int) -> list[str]:
    """Report lines for (size, site) blocks: bytes and count per site, largest first."""
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in blocks:
        by_site[site][0] += size
        by_site[site][1] += 1
    return [f"  {size / 2**20:10.1f} MiB  {count:5d} blocks  {site}"
            for site, (size, count) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]]


def _live_at_peak(trace: list[dict]) -> tuple[int, dict[int, tuple[int, list[dict]]]]:
    """Replays alloc / free_completed events: (the allocated peak in bytes, the blocks alive
    then: addr -> (size, frames)). Two passes (find the peak's event, then replay up to it),
    so a long trace costs linear time."""
    sizes: dict[int, int] = {}
    now = peak = 0
    peak_at = -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            sizes[ev["addr"]] = ev["size"]
            now += ev["size"]
            if now > peak:
                peak, peak_at = now, i
        elif ev["action"] == "free_completed" and ev["addr"] in sizes:
            now -= sizes.pop(ev["addr"])
    live: dict[int, tuple[int, list[dict]]] = {}
    for ev in trace[:peak_at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    return peak, live


def peak_report(trace: list[dict], top: int = 25) -> str:
    """The live blocks at the trace's allocated peak, by allocating site."""
    peak, live = _live_at_peak(trace)
    lines = [f"allocated during the trace at its peak: {peak / 2**30:.3f} GiB in {len(live)} blocks"]
    return "\n".join(lines + _by_site([(size, _site(frames)) for size, frames in live.values()], top))


def peak_stacks(trace: list[dict], min_bytes: int, depth: int = 14) -> str:
    """The blocks of at least `min_bytes` alive at the trace's allocated peak, each with the
    innermost `depth` Python frames of its allocation (where a site alone is not enough: code
    compiled or called through a library's wrapper)."""
    _, live = _live_at_peak(trace)
    big = sorted(live.values(), key=lambda b: -b[0])
    lines = []
    for size, frames in (b for b in big if b[0] >= min_bytes):
        py = [f for f in frames if f["filename"].endswith(".py")][:depth]
        lines.append(f"{size / 2**20:.1f} MiB:")
        lines += [f"    {'/'.join(f['filename'].split('/')[-3:])}:{f['line']} {f['name']}" for f in py]
    return "\n".join(lines)


def _reserved_peak(trace: list[dict], start: int) -> tuple[int, int, int]:
    """(the reserved peak's bytes over the trace's own segments, the index of the segment event that made
    it, the index of the next segment event: the window in which the reserved bytes stayed at the peak)."""
    sizes: dict[int, int] = {}
    reserved = peak = 0
    peak_at, ends = -1, len(trace)
    for i, ev in enumerate(trace):
        action = ev["action"]
        if action in ("segment_alloc", "segment_map", "segment_free", "segment_unmap"):
            if peak_at >= 0 and ends == len(trace) and i > peak_at:
                ends = i
            if action in ("segment_alloc", "segment_map"):
                sizes[ev["addr"]] = ev["size"]
                reserved += ev["size"]
                if reserved > peak and i >= start:
                    peak, peak_at, ends = reserved, i, len(trace)
            else:
                reserved -= sizes.pop(ev["addr"], ev["size"])
    return peak, peak_at, ends


def reserved_report(trace: list[dict], start: int = 0, top: int = 25, base: int = 0) -> str:
    """Replays segment and block events; while the reserved bytes stand at their peak (from the segment event
    that made it to the next segment event), at that window's most allocated moment: reserved and allocated by
    stream (a CUDA graph's capture stream holds its private pool), the live blocks by site, and what asked for
    the segment that made the peak. Peaks before event `start` (building the model) do not count.
    `base`: the bytes reserved before the trace began (0 when it was recorded from the start): the peak
    is found from the segments mapped and unmapped since, and reported with `base` added; the streams'
    and sites' figures then count only what the trace saw."""
    peak, peak_at, ends = _reserved_peak(trace, start)
    live: dict[int, tuple[int, str, int]] = {}
    segments: dict[int, tuple[int, int]] = {}
    allocated, best = 0, -1
    at_peak: tuple[dict, dict] = ({}, {})
    for i, ev in enumerate(trace[:ends]):
        action, stream = ev["action"], ev.get("stream", 0)
        if action == "alloc":
            live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])), stream)
            allocated += ev["size"]
        elif action == "free_completed" and ev["addr"] in live:
            allocated -= live.pop(ev["addr"])[0]
        elif action in ("segment_alloc", "segment_map"):
            segments[ev["addr"]] = (ev["size"], stream)
        elif action in ("segment_free", "segment_unmap"):
            segments.pop(ev["addr"], None)
        if i >= peak_at >= 0 and allocated > best:
            best, at_peak = allocated, (dict(live), dict(segments))
    blocks, segs = at_peak
    trigger = _site(trace[peak_at].get("frames", [])) if peak_at >= 0 else "?"
    lines = [f"reserved at its peak: {(base + peak) / 2**30:.3f} GiB; the segment that made it was asked for at {trigger}"]
    if base:
        lines.append(f"  ({base / 2**30:.3f} GiB reserved before the trace began; what follows counts only the trace's)")
    by_stream: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for size, stream in segs.values():
        by_stream[stream][0] += size
    for size, _, stream in blocks.values():
        by_stream[stream][1] += size
    for stream, (res, alloc) in sorted(by_stream.items()):
        lines.append(f"  stream {stream}: reserved {res / 2**30:.3f} GiB, allocated {alloc / 2**30:.3f}")
    lines.append("live blocks then (the most allocated moment at that reserved peak), by site:")
    return "\n".join(lines + _by_site([(size, site) for size, site, _ in blocks.values()], top))


def pools_report(snapshot: dict) -> str:
    """Reserved and allocated bytes by memory pool, from the snapshot's segments."""
    pools: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for seg in snapshot["segments"]:
        pool = str(tuple(seg.get("segment_pool_id", (0, 0))))
        pools[pool][0] += seg["total_size"]
        pools[pool][1] += seg["allocated_size"]
        pools[pool][2] += 1
    lines = ["segments by pool at the end (reserved / allocated GiB, segments):"]
    for pool, (total, used, count) in sorted(pools.items()):
        lines.append(f"  pool {pool}: {total / 2**30:.3f} / {used / 2**30:.3f} in {count}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reserved", action="store_true", help="the reserved peak over the first three steps")
    args = ap.parse_args()
    if args.reserved:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000)
        step = warmed_step(args, 0)
        start = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
        lines = []
        for i in range(3):
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            lines.append(f"step {i + 1}: max allocated {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB, "
                         f"max reserved {torch.cuda.max_memory_reserved() / 2**30:.3f}; "
                         f"graphs {recompute_of(step.model).graphs.stats()}")
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        report = "\n".join([f"{args.impl} {args.method} b{args.batch} x {args.seq} ckpt={args.checkpointing}",
                            *lines, reserved_report(snapshot["device_traces"][torch.cuda.current_device()], start),
                            pools_report(snapshot)])
        Path(args.out).write_text(report + "\n")
        print(report, flush=True)
        return
    step = warmed_step(args, 2)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    report = (f"{args.impl} {args.method} b{args.batch} x {args.seq} ckpt={args.checkpointing}\n"
              f"allocated before the step: {base / 2**30:.3f} GiB; max_memory_allocated during it: "
              f"{torch.cuda.max_memory_allocated() / 2**30:.3f} GiB; reserved peak "
              f"{torch.cuda.max_memory_reserved() / 2**30:.3f} GiB\n")
    report += peak_report(snapshot["device_traces"][torch.cuda.current_device()])
    Path(args.out).write_text(report + "\n")
    print(report, flush=True)


if __name__ == "__main__":
    main()
