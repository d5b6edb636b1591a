"""Where a run's memory goes, step by step, as it meets new batch layouts (a diagnosis for issues
24/26: it found the Gemma 4 leak, a reference cycle through the linked checkpoints' contexts).

    python bench/graph_memory.py --model gemma4-e2b --graphs auto --steps 40 --trace-step 7 --out mem.txt

Builds Kestrel's matrix cell (`bench.matrix_cell.cell_step`, CUDA graphs per --graphs) and steps
through the matrix's batches in turn. After each step it prints the batch's shape, whether that
layout was new, memory allocated and reserved, the step's own allocated peak (a capture step's
shows) and reserved peak, and the layer graphs' counts. For --trace-step it records the allocator's events and
reports the blocks alive at that step's peak (-1: the whole run's, warm-up captures included, and
also the moment of the run's reserved peak: reserved and allocated by stream, a graphs' capture
stream holding its private pool, and the live blocks by site) by the site that allocated them; at the end, the live blocks by site (the innermost frame of ours),
largest first; and the reserved memory by pool (the default pool, each CUDA-graph pool) after the
step that set the run's reserved peak: what `nvidia-smi` shows beyond what is allocated.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Any
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.matrix_cell import cell_step  # noqa: E402
from bench.memory_peak import _site, peak_report, reserved_report  # noqa: E402


def live_by_site(top: int = 30) -> list[str]:
    """Allocated blocks now alive, summed by allocating site (needs the history recorded)."""
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                site = _site(block.get("frames", []))
                sites[site][0] += block["size"]
                sites[site][1] += 1
    return [f"{size / 2**20:10.1f} MiB {count:6d} blocks  {site}"
            for site, (size, count) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]]


HOLE = 20 * 2**20  # torch's large-pool page under expandable segments: what `empty_cache` can unmap at the least


def reserved_by_pool(segments: list[dict]) -> list[str]:
    """Reserved bytes by memory pool and stream over the allocator's segments (`torch.cuda.memory_snapshot()`):
    the default pool (0, 0), and each private pool (CUDA graphs), each split into allocated and cached (free in
    a reserved segment), with the largest free blocks: cache a stream other than the compute stream holds serves
    only that stream, and large free blocks between live ones are fragmentation. Largest first. Also the cache in
    free blocks under `HOLE` bytes: under expandable segments `empty_cache` unmaps only whole pages (20 MiB in the
    large pool), so a block smaller than one stays reserved until a neighbour is freed (session 42's lead)."""
    pools: dict[tuple, list[Any]] = defaultdict(lambda: [0, 0, 0, []])  # reserved, allocated, segments, free sizes
    for seg in segments:
        pool = (tuple(seg.get("segment_pool_id") or (0, 0)), seg.get("stream", 0))
        pools[pool][0] += seg["total_size"]
        pools[pool][1] += seg.get("allocated_size", 0)
        pools[pool][2] += 1
        pools[pool][3] += [b["size"] for b in seg.get("blocks", []) if b.get("state") == "inactive"]
    lines = []
    for (pool, stream), (reserved, allocated, count, free) in sorted(pools.items(), key=lambda kv: -kv[1][0]):
        name = "default pool" if pool == (0, 0) else f"private pool {pool}"
        largest = ", ".join(f"{size / 2**20:.0f}" for size in sorted(free, reverse=True)[:4])
        holes = sum(size for size in free if size < HOLE)
        lines.append(f"{reserved / 2**30:8.3f} GiB reserved, {allocated / 2**30:.3f} allocated, "
                     f"{(reserved - allocated) / 2**30:.3f} cached, {count:5d} segments  {name}, stream {stream:#x}"
                     + (f"; largest free blocks {largest} MiB; {holes / 2**30:.3f} GiB in free blocks under "
                        f"{HOLE // 2**20} MiB" if largest else ""))
    return lines


def _released(recompute) -> list[str]:
    """The pools right after the run's graphs are dropped (`Recompute.release`, as a re-timing drops them; it
    collects cyclic garbage and empties the cache itself): a private pool still there is held by a live
    reference to a captured graph."""
    recompute.release()
    torch.cuda.synchronize()
    out = ["reserved by pool right after the graphs were released:"] + reserved_by_pool(torch.cuda.memory_snapshot())
    print("\n".join(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma4-e2b")
    ap.add_argument("--method", default="qlora")
    ap.add_argument("--layout", default="packed")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--graphs", default="on", choices=["on", "off", "auto"])
    ap.add_argument("--trace-step", type=int, default=0,
                    help="the step whose allocated peak is traced by site; -1: the whole run's peak (every step recorded)")
    ap.add_argument("--release-at", type=int, default=-1,
                    help="after this step, drop the graphs as a re-timing does (`release`) and report the pools "
                         "then: whether the graphs' pool goes back")
    ap.add_argument("--allocator", default="expandable", choices=["expandable", "fixed"],
                    help="torch's segments, as a run's performance.cuda_allocator sets them (a run's default: expandable)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    step = cell_step(args.model, args.method, args.layout, args.graphs, args.allocator)
    recompute = step.recompute
    lines, shapes = [f"cuda allocator: {step.allocator}; backward graphs captured in the {recompute.backward_capture}"], set()
    top_reserved, top_step, pools = 0, -1, []  # the run's reserved peak, its step, the pools after it
    whole = args.trace_step < 0  # one event log over every step, warm-up and captures included
    before = torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(max_entries=20_000_000 if whole else 1)  # frames for live blocks
    for i in range(args.steps):
        if i == args.trace_step:  # this step's events: the blocks alive at its peak
            torch.cuda.memory._record_memory_history(max_entries=2_000_000)
        torch.cuda.reset_peak_memory_stats()
        shape = tuple(step().input_ids.shape)
        torch.cuda.synchronize()
        if i == args.trace_step:
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            lines.append(f"step {i}'s allocated peak (blocks allocated in it):\n" + peak_report(trace))
            torch.cuda.memory._record_memory_history(max_entries=1)
        if torch.cuda.max_memory_reserved() > top_reserved:  # a new reserved peak: what holds it, by pool
            top_reserved, top_step = torch.cuda.max_memory_reserved(), i
            pools = reserved_by_pool(torch.cuda.memory_snapshot())
        lines.append(f"step {i:3d} batch {shape} {'new' if shape not in shapes else 'seen'}: allocated "
                     f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB, reserved {torch.cuda.memory_reserved() / 2**30:.2f}, "
                     f"step's peak {torch.cuda.max_memory_allocated() / 2**30:.2f} (reserved "
                     f"{torch.cuda.max_memory_reserved() / 2**30:.2f}); graphs {recompute.graphs.stats()}")
        shapes.add(shape)
        print(lines[-1], flush=True)
        if i == args.release_at:
            lines += _released(recompute)
    if whole:
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        lines.append("the whole run's allocated peak (blocks allocated since the first step):\n" + peak_report(trace))
        lines.append("the whole run's reserved peak, as it happened (not after its step):\n"
                     + reserved_report(trace, base=before))
    lines += [f"reserved by pool after step {top_step}, which set the run's reserved peak "
              f"({top_reserved / 2**30:.2f} GiB):"] + pools
    lines += ["live blocks by site at the end:"] + live_by_site()
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-31:]))


if __name__ == "__main__":
    main()
