"""A stand-in for `kestrel.training.run.run` that keeps its contract and costs no model: the worker runs
it when KESTREL_ENGINE_ENTRY=fake_engine:run (tests/jobs is put on the worker's PYTHONPATH).

Contract kept (see kestrel/training/run.py, kestrel/training/sft.py): resumes from the newest
`checkpoints/step-NNNNNN` in output_dir; reports metrics at every step, polls `should_stop`, then
checkpoints every `save_steps` or when asked to stop (written to `step-N.tmp` and renamed, so a
failed write leaves the previous one intact) and returns cancelled/interrupted; saves `adapter/`
at the end. Unlike the engine it raises OutOfMemoryError instead of returning `failed`, which
the worker must handle too.

Behaviour knobs (environment): FAKE_STEP_S (seconds a step), FAKE_FAIL = "oom@K" (raise
OutOfMemoryError at step K), "disk@K" (checkpoint write at step K fails with a disk-full OSError,
raised as KestrelError), "hang@K" (ignore stop requests and block from step K on), "abort@K"
(abort the process at step K, as a crash in native code does: SIGABRT).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kestrel.errors import KestrelError, OutOfMemoryError, oom_message

METRIC_NAMES = ("loss", "lr", "grad_norm", "tokens_per_s")


@dataclass
class Result:
    status: str
    output_dir: str
    step: int
    error: str | None = None


@dataclass
class Info:
    output_dir: str
    total_steps: int
    start_step: int
    device: str
    method: str


def _latest_checkpoint(out: Path) -> int:
    return max((int(p.name[5:]) for p in (out / "checkpoints").glob("step-*[0-9]")), default=0)


def _save(out: Path, step: int, fail: str) -> Path:
    final = out / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    if fail == f"disk@{step}":
        shutil.rmtree(tmp)
        err = OSError(errno.ENOSPC, "No space left on device")
        raise KestrelError(f"could not write the checkpoint at step {step}: {err}; free disk space in "
                           f"{out} and resume (the previous checkpoint is intact)") from err
    os.replace(tmp, final)
    return final


def run(config: Any, callbacks: list[Any] | None = None) -> Result:
    cbs = list(callbacks or [])
    step_s = float(os.environ.get("FAKE_STEP_S", "0.02"))
    fail = os.environ.get("FAKE_FAIL", "")
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = int(config.max_steps or 10)
    start = _latest_checkpoint(out)
    for cb in cbs:
        cb.on_start(Info(str(out), total, start, "cpu", config.method))
    print(f"fake engine: steps {start + 1}..{total}", flush=True)
    for step in range(start + 1, total + 1):
        time.sleep(step_s)
        if fail == f"oom@{step}":
            raise OutOfMemoryError(oom_message(config.batch_size, config.max_seq_length,
                                               config.gradient_checkpointing))
        metrics = {"step": step, "total_steps": total, "loss": 10.0 / step, "lr": config.learning_rate,
                   "grad_norm": 1.0 + step, "tokens_per_s": 100.0 * step}
        for cb in cbs:
            cb.on_step(metrics)
        if fail == f"abort@{step}":
            os.abort()
        while fail == f"hang@{step}":
            time.sleep(0.05)  # stuck (a deadlocked data loader, say): only a signal ends this
        stop = next((k for k in (cb.should_stop() for cb in cbs) if k), None)
        if stop or (config.save_steps and step % config.save_steps == 0 and step < total):
            path = _save(out, step, fail)
            for cb in cbs:
                cb.on_checkpoint(step, str(path))
        if stop:
            status = "cancelled" if stop == "cancel" else "interrupted"
            for cb in cbs:
                cb.on_end(status)
            return Result(status, str(out), step)
    adapter = out / "adapter"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": config.lora.r}))
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 1024)
    for cb in cbs:
        cb.on_end("completed")
    return Result("completed", str(out), total)
