"""Export jobs: the engine's export run by a worker, with progress and artifacts in the store,
their own lane beside training, the CPU niceness of workers, the command line.

The source is a LoRA adapter of the demo model built once for the module (exportkit); the
exports are the fast ones: GGUF f16 (written directly, no llama.cpp quantizer) and the adapter.
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
from sqlalchemy import update

from kestrel import jobs
from kestrel.errors import ConfigError
from exportkit import completed_run, lora_run, sha256
from jobkit import config, job, wait_for, wait_status, wait_step
from kestrel.jobs import store
from kestrel.jobs.models import CANCELLED, COMPLETED, EXPORT, FAILED, QUEUED, RUNNING, Job
from kestrel.jobs.worker import autogroup_nice

SLOW = 300.0  # each export worker imports torch and loads the demo model: seconds on a busy CPU


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("export-source")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KESTREL_HOME", str(home))  # the demo model the adapter names as base lives here
        return lora_run(home / "run")


def export_config(source: object, **overrides: object) -> dict:
    return {"kind": "export", "source": source, "format": "gguf", "quant": "f16", **overrides}


def test_export_job_writes_checked_files_with_progress_and_artifacts(lora_dir: Path) -> None:
    run_id = completed_run(lora_dir)
    job_id = jobs.submit(export_config(run_id))
    done = wait_status(job_id, timeout=SLOW)
    assert done.status == COMPLETED, jobs.log_tail(job_id)
    assert (done.kind, done.step, done.total_steps, done.stage, done.device) == (EXPORT, 100, 100, "done", "cpu")
    out = Path(done.output_dir)
    assert out.parent == Path(os.environ["KESTREL_HOME"]) / "exports" and out.name.startswith(f"job-{job_id}-")
    arts = {a.kind: a for a in jobs.list_artifacts(job_id)}
    assert set(arts) == {"gguf", "modelfile", "report", "log"}
    for kind in ("gguf", "modelfile", "report"):  # the log still grows after it is recorded
        path = Path(arts[kind].path)
        assert path.parent == out and arts[kind].size_bytes == path.stat().st_size
        assert arts[kind].checksum == sha256(path)
    assert Path(arts["gguf"].path).read_bytes()[:4] == b"GGUF"
    assert f"FROM ./{Path(arts['gguf'].path).name}" in Path(arts["modelfile"].path).read_text()
    progress = jobs.metrics_after(job_id, -1, names=["progress"])
    percents = [p.step for p in progress]
    assert percents[0] == 0 and percents[-1] == 100 and percents == sorted(set(percents)) and len(percents) >= 5
    assert all(abs(p.value - p.step / 100) < 0.01 for p in progress)
    assert not list(out.glob(".kestrel-export-*"))  # the staging folder was moved into place
    shown = json.loads(_cli("show", str(job_id), "--json").stdout)
    assert (shown["kind"], shown["status"], shown["progress"], shown["stage"]) == (EXPORT, COMPLETED, 1.0, "done")
    assert shown["config"]["source"] == str(lora_dir) and shown["config"]["source_job"] == run_id
    assert {a["kind"] for a in shown["artifacts"]} == set(arts)
    listed = json.loads(_cli("list", "--json").stdout)
    assert [(j["id"], j["kind"]) for j in listed] == [(job_id, EXPORT), (run_id, "sft")]


SUBMITTER = """
import sys, time
from kestrel import jobs
print(jobs.submit({cfg!r}), flush=True)
time.sleep(600)
"""


def test_export_survives_killing_the_process_that_submitted_it(lora_dir: Path) -> None:
    cfg = export_config(str(lora_dir), format="adapter", quant=None, check=False)
    submitter = subprocess.Popen([sys.executable, "-c", SUBMITTER.format(cfg=cfg)], stdout=subprocess.PIPE,
                                 text=True, start_new_session=True)
    job_id = int(submitter.stdout.readline())
    worker_pid = wait_for(lambda: job(job_id).pid, 60, what="the export's worker")
    os.killpg(submitter.pid, signal.SIGKILL)  # the submitter and its whole process group
    submitter.wait(timeout=10)
    submitter.stdout.close()
    done = wait_status(job_id, timeout=SLOW)
    assert done.status == COMPLETED and done.pid == worker_pid != submitter.pid, jobs.log_tail(job_id)
    names = {Path(a.path).name for a in jobs.list_artifacts(job_id, "adapter")}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names


def test_export_with_a_bad_source_fails_with_the_engine_message(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    job_id = jobs.submit(export_config(str(tmp_path / "notes")))
    failed = wait_status(job_id, timeout=SLOW)
    assert failed.status == FAILED and "is neither a training output folder" in failed.error
    assert "Traceback" not in failed.error
    assert [a.kind for a in jobs.list_artifacts(job_id)] == ["log"]


def test_export_configs_are_checked_at_submit(tmp_path: Path) -> None:
    queued = jobs.submit(config(), start=False)
    cases = [
        (export_config("demo", qaunt="q8_0"), "qaunt"),
        (export_config("demo", format="onnx"), "onnx"),
        (export_config("demo", quant="q9_z"), "q9_z"),
        (export_config("demo", format="adapter"), "quant applies to gguf and merged"),
        (export_config("demo", format="merged", quant="q4_k_m"), "merged dtype"),
        (export_config(999), "no job with id 999"),
        (export_config(f"job:{queued}"), "only completed runs"),
        (export_config(str(tmp_path / "missing")), "does not exist"),
        (export_config("demo", check="maybe"), "check must be true or false"),
        (export_config("demo", checkpoint=3), "checkpoint applies to a run"),
        (export_config(f"job:{queued}", checkpoint=3), "no complete checkpoint of step 3 .*; kept: none"),
    ]
    for cfg, words in cases:
        with pytest.raises(ConfigError, match=words):
            jobs.submit(cfg)
    assert [j.id for j in jobs.list_jobs()] == [queued]


def test_the_export_lane_does_not_wait_for_training(lora_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.2")
    training = jobs.submit(config(max_steps=1000, save_steps=0))  # minutes on the only device
    queued_training = jobs.submit(config(max_steps=2))
    wait_step(training, 1)
    export_id = jobs.submit(export_config(str(lora_dir), format="adapter", quant=None, check=False))
    done = wait_status(export_id, timeout=SLOW)
    assert done.status == COMPLETED and done.device == "cpu", jobs.log_tail(export_id)
    assert job(training).status == RUNNING and job(queued_training).status == QUEUED
    jobs.cancel(training)
    assert wait_status(training).status == CANCELLED


def test_claims_keep_one_export_at_a_time_beside_training() -> None:
    """The lanes as the scheduler sees them: exports never take a training slot, nor the reverse."""
    train_a, train_b = (jobs.submit(config(), start=False) for _ in range(2))
    exp_a, exp_b = (jobs.submit(export_config("demo"), start=False) for _ in range(2))
    assert store.claim_next(["cpu"]) == (train_a, "cpu")
    assert store.claim_next(["cpu"]) == (exp_a, "cpu")  # the CPU is busy training: the export runs too
    assert store.claim_next(["cpu"]) is None  # train_b waits for the CPU, exp_b for the export slot
    with store.session(immediate=True) as s:
        s.execute(update(Job).where(Job.id == exp_a).values(status=COMPLETED))
    assert store.claim_next(["cpu"]) == (exp_b, "cpu")
    assert job(train_b).status == QUEUED
    with store.session(immediate=True) as s:  # with GPUs: an idle one, never the training one
        s.execute(update(Job).where(Job.id.in_((train_a, exp_b))).values(status=QUEUED, device=None))
    assert store.claim_next(["cuda:0", "cuda:1"]) == (train_a, "cuda:0")
    assert store.claim_next(["cuda:0", "cuda:1"]) == (train_b, "cuda:1")
    assert store.claim_next(["cuda:0", "cuda:1"]) == (exp_b, "cpu")


def _niceness(pid: int) -> set[int]:
    """The nice value of every thread of `pid` (Linux keeps one per thread)."""
    return {int(Path(task, "stat").read_text().rsplit(")", 1)[1].split()[16])
            for task in Path(f"/proc/{pid}/task").iterdir()}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_cpu_jobs_run_at_lower_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_DEVICES", "cpu,cuda:0")  # a pretend GPU: the fake engine ignores it
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    seen = {}
    for device in ("cpu", "cuda:0"):
        job_id = jobs.submit(config(max_steps=100, save_steps=0), device=device)
        worker = wait_step(job_id, 2)  # heartbeat and checksum threads are running by now
        seen[device] = _niceness(worker.pid), autogroup_nice(worker.pid)
        jobs.cancel(job_id)
        wait_status(job_id)
    # The session too: under autogroup scheduling a thread's nice value only ranks it in its session.
    # The worker starts a session of its own, so with a kernel that has autogroups its file reads
    # a nice value even where ours reads empty (a process left in the default group, as in CI).
    kernel_has_autogroup = Path("/proc/self/autogroup").exists()
    cpu_group, gpu_group = (10, 0) if kernel_has_autogroup else (None, None)
    assert seen == {"cpu": ({min(19, ours + 10)}, cpu_group), "cuda:0": ({ours}, gpu_group)}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_job_queued_behind_a_cpu_job_starts_at_normal_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job that starts when a CPU job ends is started by that job's supervisor, which runs at
    the submitter's priority: a reniced launcher would hand its low priority on for good."""
    monkeypatch.setenv("KESTREL_DEVICES", "cpu,cuda:0")
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    first = jobs.submit(config(max_steps=100, save_steps=0), device="cpu")
    wait_step(first, 1)
    second = jobs.submit(config(max_steps=100, save_steps=0), device="cuda:0", start=False)
    jobs.cancel(first)
    # No schedule() from here: only the first job's processes can start the second.
    worker = wait_for(lambda: (j := job(second)).status == RUNNING and j.step >= 2 and j, 60.0,
                      "the queued job to be started when the first ended", poll_s=0.05)
    try:
        assert job(first).status == CANCELLED
        assert _niceness(worker.pid) == {ours}
        assert autogroup_nice(worker.pid) in (None, 0)
    finally:
        jobs.cancel(second)
        wait_status(second)


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_job_started_when_a_gpu_job_ends_runs_on_the_gpu_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first job's supervisor sees only its own GPU in CUDA_VISIBLE_DEVICES; the job it starts
    must still be placed among the launcher's GPUs, on the one the store records for it."""
    monkeypatch.delenv("KESTREL_DEVICES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # pretend GPUs (the fake engine ignores them): cuda:1 is 5
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    first = jobs.submit(config(max_steps=100, save_steps=0), device="cuda:1")
    assert _environ(wait_step(first, 1).pid)["CUDA_VISIBLE_DEVICES"] == "5"
    second = jobs.submit(config(max_steps=100, save_steps=0), start=False)  # the first free GPU
    jobs.cancel(first)
    # No schedule() from here: only the first job's processes can start the second.
    worker = wait_for(lambda: (j := job(second)).status == RUNNING and j.step >= 1 and j, 60.0,
                      "the queued job to be started when the first ended", poll_s=0.05)
    try:
        visible = _environ(worker.pid)["CUDA_VISIBLE_DEVICES"]
        assert (worker.device, visible) in {("cuda:0", "3"), ("cuda:1", "5")}, (worker.device, visible)
    finally:
        jobs.cancel(second)
        wait_status(second)


def test_a_running_export_stops_on_cancel_leaving_no_partial_file(lora_dir: Path) -> None:
    job_id = jobs.submit(export_config(str(lora_dir)))
    # Freeze the worker mid-export so the cancel lands before it can finish, however fast it is.
    pid = wait_for(lambda: (j := job(job_id)).status == RUNNING and 1 <= j.step < 60 and j.pid,
                   SLOW, "the export to be under way", poll_s=0.01)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert jobs.cancel(job_id) == "stopping"
        time.sleep(0.3)  # past the hook's poll interval: its next call reads the request
    finally:
        os.kill(pid, signal.SIGCONT)
    stopped = wait_status(job_id, timeout=SLOW)
    assert stopped.status == CANCELLED and stopped.error is None, jobs.log_tail(job_id)
    assert sorted(p.name for p in Path(stopped.output_dir).iterdir()) == ["job.log"]
    assert [a.kind for a in jobs.list_artifacts(job_id)] == ["log"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kestrel", "jobs", *args], capture_output=True, text=True, timeout=120)


def test_command_line_export_and_export_yaml(tmp_path: Path) -> None:
    run_id = completed_run(tmp_path / "run")
    made = _cli("export", str(run_id), "--format", "gguf", "--quant", "q4_k_m", "--no-start")
    assert made.returncode == 0, made.stderr
    first = job(int(made.stdout))
    assert (first.kind, first.status, first.name) == (EXPORT, QUEUED, f"run-{run_id}-gguf-q4_k_m")
    assert (first.config["quant"], first.config["source"]) == ("q4_k_m", str(tmp_path / "run"))
    spec = tmp_path / "export.yaml"
    spec.write_text(f"kind: export\nsource: {run_id}\nformat: merged\n")
    made = _cli("submit", str(spec), "--quant", "bf16", "--no-start")  # overrides as for training
    assert made.returncode == 0, made.stderr
    assert job(int(made.stdout)).config["quant"] == "bf16"
    spec.write_text(f"source: {run_id}\nformat: gguf\nqaunt: q8_0\n")  # export-shaped, no kind
    refused = _cli("submit", str(spec))
    assert refused.returncode == 2 and "unknown config key qaunt" in refused.stderr
    refused = _cli("export", "999")
    assert refused.returncode == 2 and "no job with id 999" in refused.stderr
    (tmp_path / "run" / "checkpoints" / "step-000004").mkdir(parents=True)  # complete once state.json is in
    (tmp_path / "run" / "checkpoints" / "step-000004" / "state.json").write_text('{"step": 4}')
    made = _cli("export", str(run_id), "--checkpoint", "4", "--format", "adapter", "--no-start")
    assert made.returncode == 0, made.stderr
    at_step = job(int(made.stdout))
    assert (at_step.name, at_step.config["source"]) == (f"run-{run_id}-step4-adapter",
                                                       str(tmp_path / "run" / "checkpoints" / "step-000004"))
    refused = _cli("export", str(run_id), "--checkpoint", "5")
    assert refused.returncode == 2 and "no complete checkpoint of step 5" in refused.stderr and "kept: 4" in refused.stderr


@pytest.mark.parametrize("text, nice", [("/autogroup-657 nice 0\n", 0), ("/autogroup-12 nice 10\n", 10),
                                        ("", None)])  # empty: a process in a cgroup of its own (CI containers)
def test_autogroup_nice_reads_the_session_nice_or_none(monkeypatch: pytest.MonkeyPatch, text: str,
                                                       nice: int | None) -> None:
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text)
    assert autogroup_nice(1) == nice
