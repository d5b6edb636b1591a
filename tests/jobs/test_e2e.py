"""Jobs running the real engine on the built-in demo model (CPU): complete, survive their
submitter, lose their worker and resume, stop, run out of memory, fill the disk.

Each worker imports torch and transformers and loads the demo model, so these take seconds each;
faults are injected by tests/jobs/engine_faults.py around the real `kestrel.training.run.run`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from kestrel import jobs
from jobkit import config, job, steps, wait_for, wait_status, wait_step
from kestrel.jobs import runner, store
from kestrel.jobs.models import CANCELLED, COMPLETED, FAILED, INTERRUPTED, QUEUED, RUNNING, Metric

REPORTED = {"loss", "lr", "grad_norm", "tokens_per_s", "epoch", "elapsed_s", "eta_s"}
SLOW = 600.0  # generous deadlines: a loaded CI machine trains the demo at ~1 step a second


@pytest.fixture(autouse=True)
def real_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_ENGINE_ENTRY", "engine_faults:run_paced")
    monkeypatch.setenv("PACE_S", "0.1")
    # One thread per worker: on a small shared CI machine, torch's thread pool spinning against
    # other processes makes each tiny step several times slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def demo(**overrides: object) -> dict:
    return config(max_seq_length=64, gradient_checkpointing="off", **overrides)


def _names_per_step(job_id: int) -> set[frozenset[str]]:
    with store.session() as s:
        rows = s.execute(select(Metric.step, Metric.name).where(Metric.job_id == job_id)).all()
    by_step: dict[int, set[str]] = {}
    for step, name in rows:
        by_step.setdefault(step, set()).add(name)
    return {frozenset(names) for names in by_step.values()}


def _jsonl_steps(output_dir: str) -> list[int]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


SUPERVISOR = """
from kestrel import jobs
job_id = jobs.submit({cfg!r})
print(job_id, flush=True)
for chunk in jobs.follow_log(job_id):
    pass
"""


def test_demo_job_completes_after_its_submitter_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACE_S", "0.2")  # the kill must land mid-run
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR.format(cfg=demo(max_steps=16, save_steps=4))],
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
    job_id = int(supervisor.stdout.readline())
    worker_pid = wait_step(job_id, 2, timeout=SLOW).pid
    os.killpg(supervisor.pid, signal.SIGKILL)
    supervisor.wait(timeout=30)
    supervisor.stdout.close()
    assert job(job_id).status == RUNNING
    done = wait_status(job_id, timeout=SLOW)
    assert done.status == COMPLETED and done.pid == worker_pid, jobs.log_tail(job_id)
    log = jobs.log_tail(job_id, 400)
    assert "[engine]" in log and "\r" not in log and "Loading weights" not in log, log  # no progress bars
    assert "pip install kernels" not in log, log  # nor bitsandbytes asking for an optional CPU kernel
    assert steps(job_id) == list(range(1, 17)) and _jsonl_steps(done.output_dir) == list(range(1, 17))
    (names,) = _names_per_step(job_id)  # every step reported the same metrics
    assert REPORTED <= names
    adapter = jobs.list_artifacts(job_id, "adapter")
    assert [Path(a.path).name for a in adapter] == ["adapter"] and adapter[0].size_bytes > 0
    # The engine keeps the newest two checkpoints; rows of removed ones are pruned.
    assert [a.step for a in jobs.list_artifacts(job_id, "checkpoint")] == [8, 12]
    assert {a.kind for a in jobs.list_artifacts(job_id)} >= {"adapter", "checkpoint", "config", "log", "metrics"}
    shown = subprocess.run([sys.executable, "-m", "kestrel", "jobs", "show", str(job_id), "--json"],
                           capture_output=True, text=True, check=True)
    summary = json.loads(shown.stdout)
    assert {k: summary[k] for k in ("id", "status", "step", "total_steps", "error")} == {
        "id": job_id, "status": COMPLETED, "step": 16, "total_steps": 16, "error": None}
    assert summary["pid"] == worker_pid and "loss" in summary["last_metrics"]


def test_demo_worker_killed_is_interrupted_and_resume_continues_the_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACE_S", "0.2")  # the kill must land mid-run
    job_id = jobs.submit(demo(max_steps=16, save_steps=4))
    pid = wait_step(job_id, 6, timeout=SLOW).pid
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    lost = wait_status(job_id, INTERRUPTED, timeout=20)
    assert time.monotonic() - killed_at < 15 and "resume" in lost.error
    before = {p.step: p.value for p in jobs.metrics_after(job_id, 0, names=["loss"])}
    monkeypatch.setenv("PACE_S", "0")
    jobs.resume(job_id)
    done = wait_status(job_id, timeout=SLOW)
    assert done.status == COMPLETED and done.attempts == 2, jobs.log_tail(job_id)
    assert steps(job_id) == list(range(1, 17)) and _jsonl_steps(done.output_dir) == list(range(1, 17))
    after = {p.step: p.value for p in jobs.metrics_after(job_id, 0, names=["loss"])}
    assert all(after[s] == before[s] for s in range(1, 5))  # up to the checkpoint: kept as logged
    assert "resuming from step-0000" in jobs.log_tail(job_id, 400)


def test_demo_cancel_a_queued_and_a_running_job_then_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    first = jobs.submit(demo(max_steps=24, save_steps=0))
    second = jobs.submit(demo(max_steps=4))
    assert job(second).status == QUEUED and jobs.cancel(second) == CANCELLED
    wait_step(first, 2, timeout=SLOW)
    assert jobs.cancel(first) == "stopping"
    stopped = wait_status(first, timeout=SLOW)
    assert stopped.status == CANCELLED and stopped.error is None and stopped.step < 24
    checkpoint = Path(stopped.output_dir) / "checkpoints" / f"step-{stopped.step:06d}"
    assert (checkpoint / "state.json").is_file()  # saved at the step boundary where it stopped
    assert job(second).started_at is None
    monkeypatch.setenv("PACE_S", "0")
    jobs.resume(first)
    done = wait_status(first, timeout=SLOW)
    assert done.status == COMPLETED and steps(first) == list(range(1, 25))
    with store.session() as s:
        assert s.scalar(select(func.count()).where(Metric.job_id == second)) == 0


def test_demo_out_of_memory_fails_with_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_ENGINE_ENTRY", "engine_faults:run_oom")
    monkeypatch.setenv("FAULT_STEP", "3")
    job_id = jobs.submit(demo(max_steps=8, batch_size=4))
    failed = wait_status(job_id, timeout=SLOW)
    assert failed.status == FAILED, jobs.log_tail(job_id)
    assert "out of memory" in failed.error and "batch_size (now 4)" in failed.error
    assert steps(job_id) == [1, 2]
    # The worker exits (after starting any queued job), and its GPU memory goes with it.
    wait_for(lambda: not runner._worker_alive(failed.pid, job_id), 60, what="the worker to exit")


def test_demo_disk_full_while_checkpointing_keeps_the_previous_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_ENGINE_ENTRY", "engine_faults:run_disk_full")
    monkeypatch.setenv("FAULT_STEP", "4")
    job_id = jobs.submit(demo(max_steps=8, save_steps=2))
    failed = wait_status(job_id, timeout=SLOW)
    assert failed.status == FAILED, jobs.log_tail(job_id)
    assert "No space left on device" in failed.error and "step-000002 is intact" in failed.error
    checkpoints = Path(failed.output_dir) / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step-000002"]  # no half-written step 4
    assert json.loads((checkpoints / "step-000002" / "state.json").read_text())["step"] == 2


def test_demo_torch_save_failing_on_a_full_disk_fails_the_job_and_every_command_works(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save on a full disk raises RuntimeError ("unexpected pos"), not OSError: the job still
    ends `failed` with the checkpoint that is intact and the space to free, no .tmp is left, the
    command line answers, and a resume finishes."""
    monkeypatch.setenv("KESTREL_ENGINE_ENTRY", "engine_faults:run_disk_full")
    monkeypatch.setenv("FAULT_STEP", "4")
    monkeypatch.setenv("FAULT_ERROR", "torch")
    job_id = jobs.submit(demo(max_steps=6, save_steps=2))
    failed = wait_status(job_id, timeout=SLOW)
    assert failed.status == FAILED, jobs.log_tail(job_id)
    assert "could not write the checkpoint of step 4: writing optimizer.pt failed (RuntimeError" in failed.error
    assert "step-000002 is intact" in failed.error and "a checkpoint needs about" in failed.error
    checkpoints = Path(failed.output_dir) / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step-000002"]
    for command in (["list"], ["show", str(job_id)], ["logs", str(job_id)]):
        done = subprocess.run([sys.executable, "-m", "kestrel", "jobs", *command], capture_output=True, text=True)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr)
    monkeypatch.setenv("KESTREL_ENGINE_ENTRY", "engine_faults:run_paced")
    monkeypatch.setenv("PACE_S", "0")
    jobs.resume(job_id)
    done = wait_status(job_id, timeout=SLOW)
    assert done.status == COMPLETED and steps(job_id) == list(range(1, 7)), jobs.log_tail(job_id)
