"""What is alive on the GPU at a training step's memory peak, and who allocated it.

    python bench/memory_peak.py --impl kestrel --out peak.txt [--checkpointing offload]

Runs two warm-up steps, then records one step with torch's CUDA allocator history
(`torch.cuda.memory._record_memory_history`). Replays the allocation events to find the moment
the allocated bytes peak, and reports the blocks alive then that were allocated during the step,
grouped by the innermost frame of ours (engine/, kernels/, bench/) or else the innermost frame,
plus the baseline allocated before the step (weights, optimizer state, workspaces).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.train import add_model_args, warmed_step  # noqa: E402

_OURS = ("/engine/", "/kernels/", "/bench/")


def _site(frames: list[dict]) -> str:
    """The innermost frame in our code, else the innermost Python frame, as file:line fn."""
    py = [f for f in frames if f["filename"].endswith(".py")]
    pick = next((f for f in py if any(s in f["filename"] for s in _OURS)), py[0] if py else None)
    if pick is None:
        return "?"
    return f"{'/'.join(pick['filename'].split('/')[-2:])}:{pick['line']} {pick['name']}"


def peak_report(trace: list[dict], top: int = 25) -> str:
    """Replays alloc / free_completed events; returns the live blocks at the highest point."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
            now += ev["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            now -= live.pop(ev["addr"])[0]
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in at_peak.values():
        by_site[site][0] += size
        by_site[site][1] += 1
    lines = [f"allocated during the step at its peak: {peak / 2**30:.3f} GiB in {len(at_peak)} blocks"]
    for site, (size, count) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / 2**20:10.1f} MiB  {count:5d} blocks  {site}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
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
