"""The runner and worker with real processes and the fake engine (tests/jobs/fake_engine.py):
submit, queue, stop, resume, failures, kills, concurrent readers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from kestrel import jobs
from kestrel.errors import ConfigError
from jobkit import config, job, steps, wait_for, wait_status, wait_step
from kestrel.jobs import runner, store
from kestrel.jobs.models import CANCELLED, COMPLETED, FAILED, INTERRUPTED, QUEUED, RUNNING, Job, Metric


def test_submit_runs_to_completion_with_every_step_and_artifacts() -> None:
    job_id = jobs.submit(config(max_steps=12, save_steps=4))
    done = wait_status(job_id)
    assert done.status == COMPLETED and done.error is None
    assert (done.step, done.total_steps, done.attempts, done.device) == (12, 12, 1, "cpu")
    assert done.started_at <= done.finished_at and done.pid is not None
    for name in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert steps(job_id, name) == list(range(1, 13))
    kinds = {(a.kind, Path(a.path).name) for a in jobs.list_artifacts(job_id)}
    assert {("adapter", "adapter"), ("log", "job.log"), ("checkpoint", "step-000004"),
            ("checkpoint", "step-000008")} <= kinds
    assert [a.step for a in jobs.list_artifacts(job_id, "checkpoint")] == [4, 8]
    adapter = jobs.list_artifacts(job_id, "adapter")[0]
    assert adapter.size_bytes > 1024 and len(adapter.checksum) == 64
    assert "fake engine: steps 1..12" in jobs.log_tail(job_id)
    assert Path(done.output_dir).parent == Path(os.environ["KESTREL_HOME"]) / "runs"


def test_malformed_configs_are_rejected_at_submit_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lora.rr"):
        jobs.submit(config(lora={"rr": 8}))
    with pytest.raises(ConfigError, match="max_steps"):
        jobs.submit(config(max_steps=0))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: demo\nlearnin_rate: 0.1\n")
    cli = subprocess.run([sys.executable, "-m", "kestrel", "jobs", "submit", str(bad)], capture_output=True, text=True)
    assert cli.returncode == 2 and "learnin_rate" in cli.stderr and cli.stdout == ""
    assert jobs.list_jobs() == []


def test_cancel_a_queued_job_and_a_running_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    running = jobs.submit(config(max_steps=200, save_steps=50))
    queued = jobs.submit(config(max_steps=5))
    assert job(queued).status == QUEUED
    assert jobs.cancel(queued) == CANCELLED  # at once, nothing to stop
    wait_step(running, 2)
    assert jobs.cancel(running) == "stopping"
    done = wait_status(running, timeout=30)
    assert done.status == CANCELLED and done.error is None and done.stop_request is None
    # It stopped at a step boundary after a checkpoint of that very step.
    assert (Path(done.output_dir) / "checkpoints" / f"step-{done.step:06d}").is_dir() and done.step < 200
    assert steps(running) == list(range(1, done.step + 1))
    never = job(queued)
    assert never.status == CANCELLED and never.pid is None and never.started_at is None


def test_pause_then_resume_continues_steps_without_duplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.05")
    job_id = jobs.submit(config(max_steps=80, save_steps=10))
    wait_step(job_id, 3)
    assert jobs.pause(job_id) == "stopping"
    paused = wait_status(job_id, timeout=30)
    assert paused.status == INTERRUPTED and paused.step < 80
    monkeypatch.setenv("FAKE_STEP_S", "0.01")
    jobs.resume(job_id)
    done = wait_status(job_id, COMPLETED)
    assert done.attempts == 2 and steps(job_id) == list(range(1, 81))
    assert f"steps {paused.step + 1}..80" in jobs.log_tail(job_id)


def test_two_jobs_on_one_device_run_one_after_the_other() -> None:
    first = jobs.submit(config(max_steps=15))
    second = jobs.submit(config(max_steps=15))
    assert job(second).status == QUEUED
    a, b = wait_status(first), wait_status(second)
    assert a.status == b.status == COMPLETED
    assert b.started_at >= a.finished_at  # never both running on the one CPU slot
    assert steps(first) == steps(second) == list(range(1, 16))


def test_out_of_memory_fails_the_job_with_advice_and_the_queue_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FAIL", "oom@3")
    oom = jobs.submit(config(max_steps=10))
    after = jobs.submit(config(max_steps=2))  # queued behind it; too short to hit the failure
    failed = wait_status(oom)
    assert failed.status == FAILED
    assert "out of memory" in failed.error and "batch_size" in failed.error
    assert wait_status(after).status == COMPLETED  # started by the failed job's worker


def test_disk_full_while_checkpointing_fails_cleanly_keeping_the_last_checkpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FAIL", "disk@8")
    job_id = jobs.submit(config(max_steps=12, save_steps=4))
    failed = wait_status(job_id)
    assert failed.status == FAILED and "No space left" in failed.error
    out = Path(failed.output_dir)
    assert json.loads((out / "checkpoints" / "step-000004" / "state.json").read_text()) == {"step": 4}
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000004"]  # no step 8, no .tmp
    monkeypatch.delenv("FAKE_FAIL")  # space freed: resume finishes from checkpoint 4
    jobs.resume(job_id)
    assert wait_status(job_id).status == COMPLETED and steps(job_id) == list(range(1, 13))


def test_killed_worker_is_interrupted_within_15_s_and_resume_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    job_id = jobs.submit(config(max_steps=30, save_steps=5))
    pid = wait_step(job_id, 8).pid
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    lost = wait_status(job_id, INTERRUPTED, timeout=20)
    assert time.monotonic() - killed_at < 15
    assert f"pid {pid}" in lost.error and "resume" in lost.error
    monkeypatch.setenv("FAKE_STEP_S", "0.01")
    jobs.resume(job_id)
    done = wait_status(job_id)
    assert done.status == COMPLETED and done.attempts == 2 and done.pid != pid
    assert steps(job_id) == list(range(1, 31))  # steps after the checkpoint were redone, once
    with store.session() as s:
        per_step = set(s.scalars(select(func.count()).where(Metric.job_id == job_id).group_by(Metric.step)))
    assert per_step == {4}


SUPERVISOR = """
import sys
from kestrel import jobs
job_id = jobs.submit({cfg!r})
print(job_id, flush=True)
for chunk in jobs.follow_log(job_id):
    pass
"""


def test_killing_the_submitting_process_group_does_not_stop_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.05")
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR.format(cfg=config(max_steps=40))],
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
    job_id = int(supervisor.stdout.readline())
    worker_pid = wait_step(job_id, 3).pid
    os.killpg(supervisor.pid, signal.SIGKILL)  # the submitter and its whole process group
    supervisor.wait(timeout=10)
    supervisor.stdout.close()
    assert worker_pid != supervisor.pid and job(job_id).status == RUNNING
    done = wait_status(job_id)
    assert done.status == COMPLETED and done.pid == worker_pid
    assert steps(job_id) == list(range(1, 41))


def test_a_worker_that_ignores_cancel_is_killed_and_marked_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FAIL", "hang@4")
    monkeypatch.setenv("KESTREL_CANCEL_TIMEOUT_S", "0.5")
    monkeypatch.setenv("KESTREL_KILL_GRACE_S", "0.5")
    job_id = jobs.submit(config(max_steps=10, save_steps=2))
    pid = wait_step(job_id, 4).pid
    jobs.cancel(job_id)
    done = wait_status(job_id, timeout=20)
    assert done.status == CANCELLED and "killed" in done.error
    wait_for(lambda: not runner._worker_alive(pid, job_id), 5, what="the worker to be gone")


def test_concurrent_readers_see_consistent_data_while_a_job_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.005")
    job_id = jobs.submit(config(max_steps=150, save_steps=1))  # a commit every step
    problems: list[str] = []
    polled: list[tuple[int, str]] = []
    finished = threading.Event()

    def snapshot_reader() -> None:
        while not finished.is_set():
            with store.session() as s:  # one snapshot: the job row and its metrics agree
                step = s.scalar(select(Job.step).where(Job.id == job_id))
                counts = s.execute(select(Metric.step, func.count()).where(Metric.job_id == job_id)
                                   .group_by(Metric.step).order_by(Metric.step)).all()
            if [st for st, _ in counts] != list(range(1, step + 1)) or any(n != 4 for _, n in counts):
                problems.append(f"job.step={step}, rows per step={counts[-3:]}")

    def poller() -> None:
        cursor = 0
        while not finished.is_set() or cursor < 150:
            rows = jobs.metrics_after(job_id, cursor)
            polled.extend((p.step, p.name) for p in rows)
            cursor = max([cursor] + [p.step for p in rows])
            time.sleep(0.01)

    readers = [threading.Thread(target=snapshot_reader) for _ in range(2)] + [threading.Thread(target=poller)]
    for t in readers:
        t.start()
    try:
        assert wait_status(job_id).status == COMPLETED
    finally:
        finished.set()
        for t in readers:
            t.join(timeout=30)
    assert problems == []
    assert sorted(polled) == sorted((p.step, p.name) for p in jobs.metrics_after(job_id, 0))
    assert len(polled) == 150 * 4  # every row seen once by the cursor-based poller


def test_delete_refuses_a_running_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    job_id = jobs.submit(config(max_steps=100))
    wait_step(job_id, 1)
    with pytest.raises(jobs.JobError, match="running"):
        jobs.delete(job_id)
    jobs.cancel(job_id)
    out = Path(wait_status(job_id).output_dir)
    jobs.delete(job_id, remove_files=True)
    assert jobs.list_jobs() == [] and jobs.metrics_after(job_id) == [] and not out.exists()
    with pytest.raises(jobs.JobError, match=f"no job with id {job_id}"):
        jobs.get_job(job_id)


def test_worker_refuses_a_job_it_was_not_started_for() -> None:
    from kestrel.jobs import worker

    job_id = jobs.submit(config(), start=False)
    assert worker.run_job(job_id) == 2 and job(job_id).status == QUEUED


def test_a_crashed_launch_window_is_settled_after_the_heartbeat_goes_stale() -> None:
    """A scheduler killed between claiming a job and starting its worker leaves `running` with
    no pid: once the claim's heartbeat is stale the job is interrupted, not running forever."""
    job_id = jobs.submit(config(), start=False)
    assert store.claim_next(["cpu"]) == (job_id, "cpu")
    assert runner.reconcile() == []  # fresh claim: its worker may be starting
    with store.session(immediate=True) as s:
        s.get(Job, job_id).heartbeat_at = time.time() - runner.STALE_AFTER_S - 1
    assert runner.reconcile() == [job_id] and job(job_id).status == INTERRUPTED


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kestrel", "jobs", *args], capture_output=True, text=True, timeout=120)


def test_command_line_interface(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.05")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: demo\ndataset: arithmetic_chat\nmax_steps: 30\nsave_steps: 5\n")
    submitted = _cli("submit", str(cfg), "--max_steps", "20")  # overrides as in `python -m kestrel train`
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(submitted.stdout)
    queued = int(_cli("submit", str(cfg), "--max_steps", "3").stdout)
    listed = json.loads(_cli("list", "--json").stdout)
    assert [j["id"] for j in listed] == [queued, job_id]
    assert all({"id", "status", "pid", "step", "total_steps", "error"} <= set(j) for j in listed)
    followed = _cli("logs", str(job_id), "--follow")  # returns once the job has finished
    assert followed.returncode == 0 and f"job {job_id} completed" in followed.stdout
    shown = json.loads(_cli("show", str(job_id), "--json").stdout)
    assert (shown["status"], shown["step"], shown["total_steps"], shown["error"]) == (COMPLETED, 20, 20, None)
    assert shown["last_metrics"]["loss"] == pytest.approx(10.0 / 20) and shown["pid"] > 0
    assert "progress   20/20" in _cli("show", str(job_id)).stdout
    assert "fake engine: steps 1..20" in _cli("logs", str(job_id)).stdout
    refused = _cli("cancel", str(job_id))
    assert refused.returncode == 1 and "already completed" in refused.stderr
    missing = _cli("show", "999")
    assert missing.returncode == 1 and "no job with id 999" in missing.stderr
    assert wait_status(queued).status == COMPLETED  # started by the first job's worker
    assert _cli("delete", str(queued)).returncode == 0
    assert [j["id"] for j in json.loads(_cli("list", "--json").stdout)] == [job_id]


def test_cli_cancel_wait_and_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.05")
    job_id = jobs.submit(config(max_steps=200, save_steps=10))
    wait_step(job_id, 2)
    stopped = _cli("pause", str(job_id), "--wait")
    assert stopped.returncode == 0 and stopped.stdout.strip() == INTERRUPTED
    monkeypatch.setenv("FAKE_STEP_S", "0.005")
    resumed = _cli("resume", str(job_id))
    assert resumed.returncode == 0 and resumed.stdout.startswith(f"{job_id} ")
    assert wait_status(job_id).status == COMPLETED and steps(job_id) == list(range(1, 201))


def test_a_gpu_group_is_made_visible_to_its_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker of a run on several GPUs sees exactly its group, numbered from 0 (through the
    runner's own CUDA_VISIBLE_DEVICES when one is set)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    env = runner._worker_env("cuda:0,cuda:2")
    assert env["CUDA_VISIBLE_DEVICES"] == "4,6" and env["KESTREL_JOB_DEVICE"] == "cuda:0,cuda:2"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert runner._worker_env("cuda:1")["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize("launcher", [None, "", "0,2"], ids=["unset", "empty", "two"])
def test_a_worker_places_jobs_by_the_gpus_its_launcher_saw(monkeypatch: pytest.MonkeyPatch, launcher: str | None) -> None:
    """In a worker's environment CUDA_VISIBLE_DEVICES names its own job's GPU only; the devices it may
    start jobs on, and their physical GPUs, are its launcher's."""
    from kestrel import env as kestrel_env

    monkeypatch.delenv("KESTREL_DEVICES", raising=False)
    monkeypatch.delenv("KESTREL_HOST_GPUS", raising=False)
    if launcher is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", launcher)
    ours = runner.available_devices()
    worker = runner._worker_env("cuda:1" if launcher == "0,2" else "cpu")
    for key in ("CUDA_VISIBLE_DEVICES", "KESTREL_HOST_GPUS", "PYTHONPATH"):
        monkeypatch.setenv(key, worker[key])
    assert runner._worker_env("cpu")["PYTHONPATH"] == worker["PYTHONPATH"]  # the repository once, not once a launch
    assert kestrel_env.host_gpus() == launcher
    assert runner.available_devices() == ours
    if launcher == "0,2":
        assert worker["CUDA_VISIBLE_DEVICES"] == "2" and ours == ["cuda:0", "cuda:1"]
        assert runner._worker_env("cuda:0")["CUDA_VISIBLE_DEVICES"] == "0"  # from the worker: the launcher's GPU 0
