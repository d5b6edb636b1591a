"""A run trained by this process itself (`python -m kestrel train CONFIG`), recorded in the job store
as a worker's run is, so the studio lists it with its live charts, and Chat and Export find it.

    result = train_here(config, [ProgressBar()])   # the engine's result; the job is settled too

The job is stored running and held by this pid (no worker claims it); a heartbeat thread keeps it
alive, and the worker's `DbCallback` writes its metrics and relays stop requests, so Stop and
Cancel on the Runs tab reach this process too. If the process dies, the missed heartbeats settle
the job as interrupted (resumable from the studio, by a worker). Why the store and not a scan of
the run folders: the store is what every tab already reads (metrics, status, artifacts, resume),
and a folder alone cannot tell a run still going from one killed mid-way.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kestrel.config import TrainConfig, config_from_dict
from kestrel.jobs import runner, submission
from kestrel.jobs.models import COMPLETED, FAILED, INTERRUPTED, RUNNING
from kestrel.jobs.worker import DbCallback, Heartbeat, _write_result, record_outputs, resolve_entry


def _device() -> str:
    """The device the engine will train on: the first GPU the store knows of, else the CPU."""
    return next((d for d in runner.available_devices() if d.startswith("cuda")), "cpu")


def record(config: TrainConfig, pid: int) -> int:
    """Store `config` as a job already running in process `pid`, which trains it: never queued, so
    no worker claims it. Checked as a submitted run is, but for its devices: it uses what its own
    process sees."""
    sub = submission.prepare(config, _device(), runner.available_devices())
    now = time.time()
    return submission.add_job(sub, status=RUNNING, pid=pid, device=sub.device or "cpu", attempts=1,
                              queued_at=now, started_at=now, heartbeat_at=now)


def train_here(config: TrainConfig, callbacks: list[Any] | None = None) -> Any:
    """Train `config` in this process with `callbacks` and a store callback; returns the engine's
    result. The run's output folder is the store's choice when the config names none
    (KESTREL_HOME/runs/job-<id>-<name>). Ctrl-C leaves it interrupted, resumable."""
    pid = os.getpid()
    job_id = record(config, pid)
    job = runner.get_job(job_id)
    print(f"[jobs] recorded as job #{job_id}: the studio's Runs tab lists it", flush=True)
    store = DbCallback(job_id, pid, save_steps=int(job.config.get("save_steps") or 0))
    heartbeat = Heartbeat(job_id, pid)
    heartbeat.start()
    status, error = FAILED, "the run ended before the engine returned"
    try:
        result = resolve_entry()(config_from_dict(job.config), callbacks=[*(callbacks or []), store])
        status, error = getattr(result, "status", COMPLETED), getattr(result, "error", None)
        return result
    except KeyboardInterrupt:
        status, error = INTERRUPTED, "stopped with Ctrl-C; resume continues from the last checkpoint"
        raise
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        heartbeat.stopped.set()
        try:
            store.close()
            record_outputs(job_id, job.output_dir)
        finally:
            _write_result(job_id, pid, status, error)
