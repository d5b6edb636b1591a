"""Helpers shared by the jobs tests: tiny configs and polling with deadlines (never fixed sleeps)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import select, update

from kestrel.jobs import queries, runner
from kestrel.jobs.models import CANCELLED, FINISHED, QUEUED, RUNNING, Job, Metric
from kestrel.jobs.store import session


def config(**overrides: Any) -> dict[str, Any]:
    """A config the fake engine runs in about a second (and the demo model on CPU in seconds)."""
    base: dict[str, Any] = {"model": "demo", "dataset": "arithmetic_chat", "max_steps": 12,
                            "save_steps": 4, "batch_size": 2, "max_seq_length": 128}
    base.update(overrides)
    return base


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition", *,
             poll_s: float = 0.05) -> Any:
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll_s)


def job(job_id: int) -> Job:
    return queries.get_job(job_id)


def wait_status(job_id: int, statuses: tuple[str, ...] | str = FINISHED, timeout: float = 60.0) -> Job:
    """Reconcile and schedule at every poll (what the studio's timer does), until a status."""
    wanted = (statuses,) if isinstance(statuses, str) else statuses

    def done() -> Job | None:
        runner.schedule()
        j = job(job_id)
        return j if j.status in wanted else None

    return wait_for(done, timeout, f"job {job_id} to be {'/'.join(wanted)} (is {job(job_id).status})", poll_s=0.1)


def wait_step(job_id: int, step: int, timeout: float = 60.0) -> Job:
    return wait_for(lambda: (j := job(job_id)).step >= step and j, timeout, f"job {job_id} to reach step {step}",
                    poll_s=0.02)


def steps(job_id: int, name: str = "loss") -> list[int]:
    """The steps that have a row for metric `name`, in order (duplicates would show twice)."""
    with session() as s:
        return list(s.scalars(select(Metric.step).where(Metric.job_id == job_id, Metric.name == name)
                              .order_by(Metric.step)))


def stop_workers() -> None:
    """Cancel what is queued (so no finishing worker starts it), then kill what still runs (only
    the workers of this test's KESTREL_HOME)."""
    with session(immediate=True) as s:
        s.execute(update(Job).where(Job.status == QUEUED).values(status=CANCELLED))
    for job in queries.list_jobs(status=RUNNING):
        if job.pid:
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in list(runner._CHILDREN.values()):
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    runner._CHILDREN.clear()
