"""Starting, stopping and supervising jobs: the public API the studio and the command line call.

    job_id = submit({"model": "demo", "dataset": "arithmetic_chat", "max_steps": 20})
    export_id = submit({"kind": "export", "source": job_id, "format": "gguf", "quant": "q4_k_m"})
    cancel(job_id); resume(job_id); wait(job_id)

Every job runs in its own worker process (`python -m kestrel.jobs.worker ID`), in a new session, so it
keeps running when the studio, the terminal or whatever started it goes away. That process forks
once: the child runs the job, the parent supervises it (`kestrel.jobs.supervisor`), settling the
job the moment the worker dies without settling it itself. Their stdout and stderr go to
`<output_dir>/job.log`, never to a pipe someone must drain.

Two lanes, each first in, first out:
- training (sft, grpo, preference): one job per device at a time (KESTREL_JOBS_PER_DEVICE), the CPU when
  there is no GPU;
- export: one export at a time (KESTREL_EXPORT_SLOTS), whatever training runs. An export is
  minutes of work that a user waits for, so it never queues behind a training run of hours:
  it takes a GPU no training job holds, else the CPU, unless its config pins a device.
Jobs on the CPU run at lower priority (`kestrel.jobs.worker.lower_priority`).

There is no daemon. `schedule()` starts queued jobs on free devices and is called by `submit`,
`resume`, every command-line command, the studio's poll (`list_jobs`/`get_job`) and each worker
and each supervisor as its worker ends, so the queue drains with nothing else open. It first calls
`reconcile()`, which marks a running job whose process is gone and whose heartbeat is stale as
`interrupted` (the fallback for a job whose supervisor is gone too: a machine restart, a kill of
both), and kills a worker that ignored a cancel or pause request for KESTREL_CANCEL_TIMEOUT_S.
POSIX only (process groups, /proc or kill(pid, 0)).
"""

from __future__ import annotations

import codecs
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import delete as sql_delete
from sqlalchemy import select, update

from kestrel import env as kestrel_env
from kestrel.constants import signal_name
from kestrel.processes import pid_exists
from kestrel.config import TrainConfig
from kestrel.paths import kestrel_home
from kestrel.jobs import preflight, queries, submission
from kestrel.jobs.models import CANCELLED, EXPORT, FINISHED, INTERRUPTED, QUEUED, RESUMABLE, RUNNING, Artifact, Job, Metric
from kestrel.jobs.submission import LOG_NAME
from kestrel.jobs.store import (
    JobError, StoreWriteError, claim_next, device_group, remove_job_files, require_job, session,
)

HEARTBEAT_S = 2.0  # the worker's heartbeat period
STALE_AFTER_S = 6.0  # three missed heartbeats: with a dead pid, the job is lost (well under 15 s)
REFRESH_EVERY_S = 1.0  # list_jobs / get_job reconcile at most this often per process
REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: workers import kestrel from it
NO_RESULT_EXIT = 3  # a worker's exit code when it finished but could not store its result

_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}  # worker processes (supervisors) started here, to reap them
_last_refresh = 0.0
log = logging.getLogger("kestrel.jobs")


def available_devices() -> list[str]:
    """Devices a job may be given: KESTREL_DEVICES ("cpu", "cuda:0,cuda:1") when set, else one
    entry per visible GPU (found without importing torch, so the command line stays fast), else
    ["cpu"]."""
    spec = kestrel_env.raw("KESTREL_DEVICES")
    if spec:
        return [d.strip() for d in spec.split(",") if d.strip()]
    visible = kestrel_env.host_gpus()
    if visible is not None:
        count = len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
    else:
        count = len(list(Path("/dev").glob("nvidia[0-9]*")))
    return [f"cuda:{i}" for i in range(count)] or ["cpu"]


# ---------------------------------------------------------------------------------------------
# Submitting and controlling jobs


def submit(config: dict[str, Any] | TrainConfig, *, device: str | None = None, start: bool = True,
           dataset_id: int | None = None) -> int:
    """Validate `config` (a ConfigError names any bad key), queue it, start it if it can start.

    A training config (TrainConfig or its dict) makes an sft, grpo or preference job; an export config
    (`kind: export`, see `kestrel.jobs.export_job`) an export job. Relative file paths in the config are
    made absolute here, since the worker runs elsewhere. `device` pins the job ("cpu",
    "cuda:1"); None takes the first free device (an export: see `_export_device` in kestrel.jobs.store).

    Everything that would fail in the worker for a reason known now (a missing dataset or model,
    an output folder that is a file or cannot be created) is refused here, and a refused config
    stores nothing: the output folder is created inside the transaction that adds the job
    (`kestrel.jobs.submission`).
    """
    sub = submission.prepare(config, device, available_devices())
    if sub.kind != EXPORT:
        preflight.check_devices(sub.data.get("devices", 1), sub.device, available_devices())
    job_id = submission.add_job(sub, dataset_id=dataset_id)
    if start:
        schedule()
    return job_id


def cancel(job_id: int) -> str:
    """Cancel a job. Queued: `cancelled` at once. Running: the request is stored and the worker
    stops at its next step boundary after a checkpoint, an export at its next progress report
    with no partial file left (returns "stopping")."""
    return _request_stop(job_id, "cancel")


def pause(job_id: int) -> str:
    """Like cancel, but the job ends `interrupted`, ready for `resume`."""
    return _request_stop(job_id, "pause")


def _request_stop(job_id: int, kind: str) -> str:
    now = time.time()
    with session(immediate=True) as s:
        job = require_job(s, job_id)
        if job.status == QUEUED:
            job.status = CANCELLED if kind == "cancel" else INTERRUPTED
            job.finished_at = now
            return job.status
        if job.status != RUNNING:
            raise JobError(f"job {job_id} is already {job.status}; only queued or running jobs stop")
        if job.stop_request != "cancel":  # a pause never softens an earlier cancel
            job.stop_request = kind
        job.stop_requested_at = job.stop_requested_at or now  # the clock of the kill fallback
        return "stopping"


def resume(job_id: int, start: bool = True) -> int:
    """Queue an interrupted, cancelled or failed job again. The engine resumes from the last
    checkpoint in the job's output_dir; its metrics past that step are replaced, not repeated.
    An export runs again from the start."""
    with session(immediate=True) as s:
        job = require_job(s, job_id)
        if job.status not in RESUMABLE:
            raise JobError(f"job {job_id} is {job.status}; only {', '.join(RESUMABLE)} jobs resume")
        for key in ("pid", "device", "stop_request", "stop_requested_at", "error", "finished_at"):
            setattr(job, key, None)
        job.status = QUEUED
        job.queued_at = time.time()  # to the back of the queue
    if start:
        schedule()
    return job_id


def delete(job_id: int, remove_files: bool = False) -> None:
    """Forget a job that is not running (its metrics and artifacts too); `remove_files` also
    deletes its folder when that lies under KESTREL_HOME."""
    with session(immediate=True) as s:
        job = require_job(s, job_id)
        if job.status == RUNNING:
            raise JobError(f"job {job_id} is running; cancel it first (python -m kestrel jobs cancel {job_id})")
        output_dir = job.output_dir
        s.execute(sql_delete(Metric).where(Metric.job_id == job_id))
        s.execute(sql_delete(Artifact).where(Artifact.job_id == job_id))
        s.delete(job)
    if remove_files:
        remove_job_files(output_dir)


# ---------------------------------------------------------------------------------------------
# Scheduling and supervision


def schedule() -> list[int]:
    """Reconcile, then start queued jobs while devices are free; returns the started ids."""
    reconcile()
    slots = int(kestrel_env.number("KESTREL_JOBS_PER_DEVICE", 1))
    export_slots = int(kestrel_env.number("KESTREL_EXPORT_SLOTS", 1))
    started = []
    while (claim := claim_next(available_devices(), slots, export_slots)) is not None:
        _launch(*claim)
        started.append(claim[0])
    return started


def _launch(job_id: int, device: str) -> None:
    """Start the worker process of a job already claimed as running on `device`. It forks into a
    supervisor and the worker; the worker's pid is recorded by both (whichever comes first)."""
    job = queries.get_job(job_id)
    Path(job.output_dir).mkdir(parents=True, exist_ok=True)
    log_path = job.log_path or str(Path(job.output_dir) / LOG_NAME)
    with open(log_path, "ab") as log_file:
        log_file.write(f"--- job {job_id}, attempt {job.attempts}, on {device}, "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode())
        log_file.flush()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kestrel.jobs.worker", str(job_id)], cwd=job.output_dir,
                env=_worker_env(device), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True)
        except OSError as exc:
            fail_launch(job_id, f"could not start the worker: {exc}")
            return
    _CHILDREN[proc.pid] = proc


def fail_launch(job_id: int, error: str) -> None:
    """Mark a claimed job whose worker could not be started `failed` with `error`."""
    with session() as s:
        job = s.get(Job, job_id)
    if job is not None and job.pid is None:
        _finish_lost(job_id, job.heartbeat_at, None, "failed", error)


def record_worker_pid(job_id: int, pid: int) -> None:
    """Record the pid of a job's worker (the worker writes it too; whichever comes first)."""
    with session(immediate=True) as s:
        s.execute(update(Job).where(Job.id == job_id, Job.status == RUNNING, Job.pid.is_(None)).values(pid=pid))


def _worker_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])  # once, however long the chain of launches
    env["PYTHONUNBUFFERED"] = "1"  # the log file shows progress as it happens
    env["KESTREL_HOME"] = str(kestrel_home())
    host = kestrel_env.host_gpus()
    env.update(kestrel_env.job_environment(device, host))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif device.startswith("cuda:"):  # one GPU, or a group of them ("cuda:0,cuda:1") for one run
        visible = [v.strip() for v in (host or "").split(",") if v.strip()]
        indices = [int(d.split(":", 1)[1]) for d in device_group(device)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] if i < len(visible) else str(i) for i in indices)
    return env


def reconcile() -> list[int]:
    """Settle running jobs whose worker is gone; escalate stop requests that were ignored.

    A job is lost when its pid no longer runs `kestrel.jobs.worker` for it and its heartbeat is older
    than STALE_AFTER_S: it becomes `interrupted` (resumable), or `cancelled` if a cancel was
    asked. A worker still alive KESTREL_CANCEL_TIMEOUT_S after a stop request gets SIGTERM on
    its process group, and SIGKILL KESTREL_KILL_GRACE_S later. Returns the ids it settled.
    """
    for pid, proc in list(_CHILDREN.items()):
        if proc.poll() is not None:  # reaps our own finished workers (no zombies)
            _CHILDREN.pop(pid, None)
    now = time.time()
    with session() as s:
        running = list(s.scalars(select(Job).where(Job.status == RUNNING)))
    settled = []
    for job in running:
        alive = _worker_alive(job.pid, job.id)
        killed = False
        if alive and job.stop_request:
            killed = _escalate(job, now)
            alive = alive and not (killed and _wait_gone(job.pid, job.id, 3.0))
        if alive:
            continue
        if not killed and job.heartbeat_at is not None and now - job.heartbeat_at < STALE_AFTER_S:
            continue
        status, error = _lost_status(job, killed)
        if _finish_lost(job.id, job.heartbeat_at, job.pid, status, error):
            settled.append(job.id)
    return settled


def _lost_status(job: Job, killed: bool, how: str = "ended") -> tuple[str, str | None]:
    """The status and message of a running job whose worker is gone; `how` says how it ended
    ("was killed by SIGKILL", "exited with code 1"), `killed`: by our escalation of a stop request."""
    if killed:
        waited = kestrel_env.number("KESTREL_CANCEL_TIMEOUT_S", 120)
        note = f"the worker did not stop within {waited:g} s of the {job.stop_request} request and was killed"
        return (CANCELLED if job.stop_request == "cancel" else INTERRUPTED), note
    if job.stop_request == "cancel":
        return CANCELLED, None if how == "ended" else f"the worker process (pid {job.pid}) {how} while stopping"
    again = "runs the export again" if job.kind == EXPORT else "continues from the last checkpoint"
    cause = {"ended": "killed, or the machine restarted",
             exit_description(NO_RESULT_EXIT): "it could not store its result, which the job log shows"
             }.get(how, "the job log shows its last words")
    return INTERRUPTED, (f"the worker process (pid {job.pid}) {how} without reporting a result "
                         f"({cause}); `python -m kestrel jobs resume {job.id}` {again}")


def exit_description(returncode: int) -> str:
    """How a process ended, from its wait status: "was killed by SIGKILL", "exited with code 1"."""
    name = signal_name(returncode)
    return f"exited with code {returncode}" if name is None else f"was killed by {name}"


def settle_exited(job_id: int, pid: int, returncode: int) -> str | None:
    """Called by a worker's supervisor once the worker (`pid`) has exited with `returncode`:
    settle its job if it is still running under that pid (the worker died before writing its
    result): `interrupted` (resumable), or what its stop request asked for. Returns the status
    it set, None when there was nothing to settle."""
    with session() as s:
        job = s.get(Job, job_id)
    if job is None or job.status != RUNNING or job.pid != pid:
        return None
    how = exit_description(returncode)
    timeout = kestrel_env.number("KESTREL_CANCEL_TIMEOUT_S", 120)
    escalated = bool(job.stop_request and returncode in (-signal.SIGKILL, -signal.SIGTERM)
                     and job.stop_requested_at is not None and time.time() - job.stop_requested_at >= timeout)
    status, error = _lost_status(job, escalated, how)
    return status if _finish_lost(job.id, job.heartbeat_at, pid, status, error) else None


def _finish_lost(job_id: int, heartbeat_at: float | None, pid: int | None, status: str,
                 error: str | None) -> bool:
    """Settle a running job, unless its worker wrote a heartbeat since we looked."""
    beat = Job.heartbeat_at.is_(None) if heartbeat_at is None else Job.heartbeat_at == heartbeat_at
    same_pid = Job.pid.is_(None) if pid is None else Job.pid == pid
    with session(immediate=True) as s:
        return s.execute(update(Job).where(Job.id == job_id, Job.status == RUNNING, beat, same_pid).values(
            status=status, error=error, finished_at=time.time(), stop_request=None)).rowcount == 1


def _escalate(job: Job, now: float) -> bool:
    """Signal a worker that ignores its stop request; True when SIGKILL was sent."""
    timeout = kestrel_env.number("KESTREL_CANCEL_TIMEOUT_S", 120)
    waited = now - (job.stop_requested_at or now)
    if waited < timeout or job.pid is None:
        return False
    kill = waited >= timeout + kestrel_env.number("KESTREL_KILL_GRACE_S", 10)
    try:
        # start_new_session made the worker a group leader: its group id is its pid, and the
        # group holds whatever it started (data loader workers, a quantizer subprocess).
        os.killpg(job.pid, signal.SIGKILL if kill else signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return False
    return kill


def _wait_gone(pid: int | None, job_id: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _worker_alive(pid, job_id):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _worker_alive(pid: int | None, job_id: int) -> bool:
    """Whether `pid` is a live (not zombie) `kestrel.jobs.worker` process for this job.

    The command line is checked so a pid reused by another program after a reboot or a crash
    does not keep a dead job `running` forever.
    """
    if pid is None:
        return False
    proc = _CHILDREN.get(pid)
    if proc is not None and proc.poll() is not None:
        return False
    stat = Path(f"/proc/{pid}/stat")
    if not Path("/proc/self/stat").exists():  # no procfs (macOS): existence only
        return pid_exists(pid)
    try:
        state = stat.read_text().rsplit(")", 1)[1].split()[0]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except PermissionError:
        return True
    return state not in ("Z", "X") and b"kestrel.jobs.worker" in argv and str(job_id).encode() in argv


# ---------------------------------------------------------------------------------------------
# Reading jobs (with supervision) and their logs


def _refresh() -> None:
    """Reconcile and schedule, at most every REFRESH_EVERY_S; on a disk too full for the job
    database to be written, reading goes on (with a warning) since nothing can be settled."""
    global _last_refresh
    if time.monotonic() - _last_refresh >= REFRESH_EVERY_S:
        _last_refresh = time.monotonic()
        try:
            schedule()
        except StoreWriteError as exc:
            log.warning("warning: jobs shown as last recorded: %s", exc)


def list_jobs(status: str | None = None, limit: int | None = None, kind: str | None = None) -> list[Job]:
    """Jobs, newest first, after settling lost jobs and starting queued ones (throttled)."""
    _refresh()
    return queries.list_jobs(status, limit, kind)


def get_job(job_id: int) -> Job:
    """One job, after settling lost jobs and starting queued ones (throttled)."""
    _refresh()
    return queries.get_job(job_id)


def wait(job_id: int, timeout: float | None = None, poll_s: float = 0.2) -> Job:
    """Block until the job has finished (any status in FINISHED); TimeoutError after `timeout`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        schedule()
        job = queries.get_job(job_id)
        if job.status in FINISHED:
            return job
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {job.status} after {timeout:g} s")
        time.sleep(poll_s)


def log_tail(job_id: int, n: int = 200) -> str:
    """The last `n` lines of the job's log ("" before it has started)."""
    path = queries.get_job(job_id).log_path
    if not path or not Path(path).exists():
        return ""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = pos = f.tell()
        block = b""
        while pos > 0 and block.count(b"\n") <= n:
            pos = max(0, pos - 65536)
            f.seek(pos)
            block = f.read(end - pos)
    lines = block.decode("utf-8", errors="replace").splitlines(keepends=True)
    return "".join(lines[-n:])


def follow_log(job_id: int, poll_s: float = 0.5) -> Iterator[str]:
    """The whole log, then what is appended, until the job has finished and the file is read."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offset = 0
    while True:
        job = get_job(job_id)
        done = job.status in FINISHED
        if job.log_path and Path(job.log_path).exists():
            with open(job.log_path, "rb") as f:
                f.seek(offset)
                data = f.read()
            offset += len(data)
            if data:
                yield decoder.decode(data)
                continue
        if done:
            return
        time.sleep(poll_s)
