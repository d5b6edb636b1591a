"""A lost worker is noticed by its supervisor (kestrel/jobs/supervisor.py) with nobody watching: after
the kill these tests never call into the job store (no reconcile, no schedule); they read the
database file with plain sqlite3 until the job is settled."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kestrel import jobs
from jobkit import config, steps, wait_for, wait_status
from kestrel.jobs import runner
from kestrel.jobs.models import COMPLETED, INTERRUPTED, RUNNING

LIMIT_S = 15.0  # a lost worker's job must be settled this soon


def _row(job_id: int) -> dict[str, Any]:
    """The job's row, read with sqlite3 alone (no Kestrel code runs)."""
    con = sqlite3.connect(Path(os.environ["KESTREL_HOME"]) / "kestrel.db", timeout=30)
    try:
        con.row_factory = sqlite3.Row
        row = con.execute("SELECT status, pid, step, error FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return dict(row)
    finally:
        con.close()


def _poll(job_id: int, check: Any, timeout: float, what: str) -> dict[str, Any]:
    """Read the row until `check(row)` holds; returns that row."""

    def ready() -> dict[str, Any] | None:
        row = _row(job_id)
        return row if check(row) else None

    return wait_for(ready, timeout, what, poll_s=0.05)


def _kill_and_time(job_id: int, step: int) -> tuple[int, float, dict[str, Any]]:
    """SIGKILL the job's worker once it reached `step`; (its pid, seconds until the database said
    interrupted, the row then)."""
    pid = _poll(job_id, lambda r: r["step"] >= step and r["pid"], 60, f"job {job_id} at step {step}")["pid"]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    row = _poll(job_id, lambda r: r["status"] != RUNNING, LIMIT_S + 5, f"job {job_id} settled")
    return pid, time.monotonic() - killed_at, row


def test_a_killed_worker_is_interrupted_within_15_s_with_nobody_watching(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    job_id = jobs.submit(config(max_steps=30, save_steps=5))
    supervisor = runner._CHILDREN[next(iter(runner._CHILDREN))]  # the process submit started
    pid, took, row = _kill_and_time(job_id, 7)
    assert row["status"] == INTERRUPTED and took < LIMIT_S, (row, took)
    assert f"pid {pid}" in row["error"] and "SIGKILL" in row["error"] and f"jobs resume {job_id}" in row["error"]
    assert supervisor.pid != pid and supervisor.wait(timeout=10) == 128 + signal.SIGKILL
    monkeypatch.setenv("FAKE_STEP_S", "0.01")
    jobs.resume(job_id)
    done = wait_status(job_id)
    assert done.status == COMPLETED and done.attempts == 2 and done.pid != pid
    assert steps(job_id) == list(range(1, 31))


SUBMITTER = """
from kestrel import jobs
print(jobs.submit({first!r}), jobs.submit({second!r}), flush=True)
"""


def test_with_the_submitter_gone_a_lost_worker_is_settled_and_the_queue_drains(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    code = SUBMITTER.format(first=config(max_steps=40, save_steps=5), second=config(max_steps=3))
    submitter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    first, second = map(int, submitter.stdout.readline().split())
    try:
        os.killpg(submitter.pid, signal.SIGKILL)  # gone, with its whole process group
    except ProcessLookupError:
        pass
    submitter.wait(timeout=10)
    submitter.stdout.close()
    assert _row(second)["status"] == "queued"
    _, took, row = _kill_and_time(first, 3)
    assert row["status"] == INTERRUPTED and took < LIMIT_S
    # The dead worker's supervisor started the queued job; it ran to its end.
    assert _poll(second, lambda r: r["status"] == COMPLETED, 60, f"job {second} completed")["step"] == 3


def test_a_crash_in_native_code_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FAIL", "abort@3")  # os.abort(), as llama.cpp does on a bad vocabulary
    job_id = jobs.submit(config(max_steps=10))
    row = _poll(job_id, lambda r: r["status"] != RUNNING and r["status"] != "queued", 30, f"job {job_id} settled")
    assert row["status"] == INTERRUPTED and "killed by SIGABRT" in row["error"]


def test_sigterm_to_the_supervisor_pauses_the_job_after_a_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.05")
    job_id = jobs.submit(config(max_steps=200, save_steps=50))
    (supervisor,) = runner._CHILDREN.values()
    row = _poll(job_id, lambda r: r["step"] >= 3, 60, "step 3")
    assert row["pid"] != supervisor.pid
    supervisor.send_signal(signal.SIGTERM)
    row = _poll(job_id, lambda r: r["status"] != RUNNING, 30, f"job {job_id} stopped")
    assert row["status"] == INTERRUPTED and "SIGTERM" in row["error"]
    done = jobs.get_job(job_id)
    assert (Path(done.output_dir) / "checkpoints" / f"step-{done.step:06d}").is_dir()
    # The supervisor exits once its worker has: the worker runs reniced, so on a loaded machine (the full suite on two
    # cores) its teardown waits behind other processes; it once took over 10 s there.
    assert supervisor.wait(timeout=60) == 0


@pytest.mark.parametrize("reported", [True, False], ids=["worker-reported", "worker-lost"])
def test_the_supervisor_starts_the_queue_however_the_worker_ended(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  reported: bool) -> None:
    """The next job is started by the supervisor once the worker has exited (the worker itself may run
    reniced); a failure to start it is reported as such and never raised."""
    from kestrel.jobs import supervisor

    started = []
    monkeypatch.setattr(runner, "settle_exited", lambda job_id, pid, code: None if reported else INTERRUPTED)
    monkeypatch.setattr(supervisor, "_kill_leftovers", lambda pgid: None)
    monkeypatch.setattr(runner, "schedule", lambda: started.append(1) or [])
    supervisor._settle(7, 12345, 0 if reported else -9)
    assert started == [1]

    def broken() -> list[int]:
        raise RuntimeError("database is locked")

    monkeypatch.setattr(runner, "schedule", broken)
    supervisor._settle(7, 12345, 0)
    assert "could not start the next job: database is locked" in capsys.readouterr().out
