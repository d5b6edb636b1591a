"""Profile a few steps of a Kestrel training run from inside it (a training `Callback`), for
recipes that only run through `kestrel.training.run` (DPO and the other preference methods).

    prof = StepProfiler(Path(DIR), after=8, steps=2)
    run(config, [prof])          # steps 9 and 10 profiled; the run needs at least 10 steps

Writes into DIR:
- profile.txt: the top device kernels and host ops by their own time (torch.profiler's tables,
  with the allocations each op made), kernel time by kind and the GPU's idle gaps
  (`bench.profile_train.analyse`), and the CUDA allocator's peaks;
- trace.json: the Chrome trace of the profiled steps (chrome://tracing, ui.perfetto.dev);
- memory.pickle (CUDA): the allocator's history over the profiled steps, for
  https://pytorch.org/memory_viz (which tensors make up the peak, and who allocated them).
The profiled steps run slower than the others (the profiler's own work): leave them out of timings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kestrel.training.metrics import Callback

ROWS = 30  # rows of each table


class StepProfiler(Callback):
    """Profiles steps `after + 1` .. `after + steps` (1-based, as the run reports them)."""

    def __init__(self, folder: Path, after: int, steps: int = 2) -> None:
        if after < 1 or steps < 1:
            raise ValueError(f"profile at least one step after at least one unprofiled step (after={after}, steps={steps})")
        self.folder, self.after, self.steps = folder, after, steps
        self.prof: Any = None
        self.written = False

    def on_step(self, metrics: dict[str, float]) -> None:
        step = int(metrics["step"])
        if step == self.after:
            self._begin()
        elif step == self.after + self.steps and self.prof is not None:
            self._end()

    def _begin(self) -> None:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=500_000)  # C++ unwinding is slow
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        # with_stack: the idle gaps are then told by the Python frames of ours that launched the kernel after them
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=True)
        self.prof.start()

    def _end(self) -> None:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        self.prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / "trace.json"
        self.prof.export_chrome_trace(str(trace))
        averages = self.prof.key_averages()
        parts = [f"{self.steps} profiled steps (after step {self.after}); times are totals over them\n"]
        if cuda:
            torch.cuda.memory._dump_snapshot(str(self.folder / "memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            parts.append(_allocator_peaks())
            parts.append("top device kernels by own time:\n"
                         + averages.table(sort_by="self_device_time_total", row_limit=ROWS, max_name_column_width=70))
        parts.append("top host ops by own time:\n"
                     + averages.table(sort_by="self_cpu_time_total", row_limit=ROWS, max_name_column_width=70))
        if cuda:
            from bench.profile_train import analyse

            parts.append(analyse(json.loads(trace.read_text()), self.steps))
        (self.folder / "profile.txt").write_text("\n".join(parts) + "\n")
        self.prof, self.written = None, True


def _allocator_peaks() -> str:
    """The CUDA allocator's peaks over the whole process so far, in GiB."""
    stats = torch.cuda.memory_stats()
    gib = lambda key: stats.get(key, 0) / 2**30  # noqa: E731
    return (f"allocator: peak allocated {gib('allocated_bytes.all.peak'):.3f} GiB, now {gib('allocated_bytes.all.current'):.3f};"
            f" peak reserved {gib('reserved_bytes.all.peak'):.3f} GiB\n")
