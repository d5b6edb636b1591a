"""The real engine with one fault injected, for the end-to-end tests (KESTREL_ENGINE_ENTRY =
"engine_faults:run_oom" or "engine_faults:run_disk_full"; FAULT_STEP picks the step).

run_oom: the optimizer step FAULT_STEP raises torch's CUDA out-of-memory error, as a GPU would.
run_disk_full: writing the checkpoint of step FAULT_STEP fails as a full disk makes it fail: with
OSError(ENOSPC), or with FAULT_ERROR=torch the RuntimeError torch.save raises on a full disk
("unexpected pos", no word of space), after writing part of the file.
run_paced: no fault, but every step takes at least PACE_S seconds, so a test can act mid-run
however fast the machine is.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import torch

from kestrel.training import sft
from kestrel.training.run import TrainResult, run


def _run_with_step_hook(hook: Any, config: Any, callbacks: list[Any] | None) -> TrainResult:
    """`run` with `hook(step)` called before every SFT step (`step` counts from 0)."""
    real_step = sft.accumulate

    def accumulate(s: Any, step: int) -> Any:
        hook(step)
        return real_step(s, step)

    sft.accumulate = accumulate
    try:
        return run(config, callbacks)
    finally:
        sft.accumulate = real_step


def run_oom(config: Any, callbacks: list[Any] | None = None) -> TrainResult:
    fail_at = int(os.environ["FAULT_STEP"])

    def hook(step: int) -> None:
        if step + 1 == fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    return _run_with_step_hook(hook, config, callbacks)


def run_disk_full(config: Any, callbacks: list[Any] | None = None) -> TrainResult:
    target = f"step-{int(os.environ['FAULT_STEP']):06d}.tmp"
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if Path(str(f)).parent.name == target:
            Path(str(f)).write_bytes(b"\0" * 4096)
            if os.environ.get("FAULT_ERROR") == "torch":
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        real_save(obj, f, *args, **kwargs)

    torch.save = save
    try:
        return run(config, callbacks)
    finally:
        torch.save = real_save


def run_paced(config: Any, callbacks: list[Any] | None = None) -> TrainResult:
    pace = float(os.environ.get("PACE_S", "0.1"))
    return _run_with_step_hook(lambda step: time.sleep(pace), config, callbacks)
