"""The process that runs one job: `python -m kestrel.jobs.worker JOB_ID` (started by `kestrel.jobs.runner`).

It claims nothing itself: the scheduler has already marked the job running on a device and set
CUDA_VISIBLE_DEVICES. It first forks: the parent stays behind as the worker's supervisor
(`kestrel.jobs.supervisor`: it settles the job at once if the worker dies, and once the worker has
exited it starts the next queued job, so the queue drains with no studio or terminal open); the
child goes on. On the CPU the child lowers its own priority (`lower_priority`), so the studio
stays responsive on a small machine. It records its pid, beats a heartbeat every HEARTBEAT_S on a
thread, runs the job, writes the final status and records the artifacts.

A training job runs the engine with `DbCallback` (metrics in batches, stop requests polled at
each step boundary). The engine is reached through one function named by ENGINE_ENTRY
("module:function", called as `fn(config, callbacks=[...])` and returning an object with
`status`, `error`); tests point KESTREL_ENGINE_ENTRY at a stand-in. An export job runs
`kestrel.jobs.export_job.run`, the engine's `kestrel.export.export` with a progress hook.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from kestrel import env
from kestrel.config import config_from_dict
from kestrel.errors import KestrelError
from kestrel.jobs import export_job, queries, runner, supervisor
from kestrel.jobs.models import CANCELLED, COMPLETED, EXPORT, FAILED, INTERRUPTED, RUNNING, Job
from kestrel.jobs.runner import HEARTBEAT_S, NO_RESULT_EXIT
from kestrel.jobs.store import StoreWriteError, device_group, session
from kestrel.training.best import BEST_DIR, read_best

ENGINE_ENTRY = "kestrel.training.run:run"
FLUSH_EVERY_S = 1.0  # metrics reach the store at most this late (charts stay < 2 s behind)
STOP_POLL_S = 0.2  # should_stop reads the store at most this often
RESULT_STATUSES = (COMPLETED, CANCELLED, INTERRUPTED, FAILED)
CPU_NICE = 10  # added niceness of a job on the CPU (0 normal .. 19 lowest)
RESULT_RETRY_S = 10.0  # how long a worker retries storing its result on a full disk


def resolve_entry() -> Callable[..., Any]:
    """The engine's run function, named by KESTREL_ENGINE_ENTRY or ENGINE_ENTRY."""
    spec = env.raw("KESTREL_ENGINE_ENTRY") or ENGINE_ENTRY
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise KestrelError(f"engine entry {spec!r} must read module:function")
    return getattr(importlib.import_module(module), attr)


class DbCallback:
    """Writes a run's progress to the store and relays stop requests to the engine.

    Implements every method of `kestrel.training.metrics.Callback` (checked by the tests) without
    importing it, so the worker does not pay for importing torch before the engine needs it.
    """

    def __init__(self, job_id: int, pid: int, save_steps: int = 0) -> None:
        self.job_id, self.pid, self.save_steps = job_id, pid, save_steps
        self.total_steps: int | None = None
        self.terminated = False  # set by the SIGTERM handler
        self._rows: list[tuple[int, str, float]] = []
        self._last_flush = time.monotonic()
        self._last_poll = 0.0
        self._stop: str | None = None
        self._artifacts: queue.Queue[tuple[str, str, int | None] | None] = queue.Queue()
        # Checksums of large checkpoints are computed off the training thread.
        self._hasher = threading.Thread(target=self._hash_loop, name="artifacts", daemon=True)
        self._hasher.start()

    def on_start(self, info: Any) -> None:
        self.total_steps = int(info.total_steps)
        start = int(info.start_step)
        # A resumed run repeats the steps after its checkpoint: drop the old rows first.
        queries.truncate_metrics(self.job_id, start)
        with session(immediate=True) as s:
            s.execute(update(Job).where(Job.id == self.job_id).values(total_steps=self.total_steps))
        print(f"[jobs] training {self.total_steps} steps from step {start} on {info.device}", flush=True)

    def on_step(self, metrics: dict[str, float]) -> None:
        step = int(metrics["step"])
        self._rows.extend((step, k, float(v)) for k, v in metrics.items()
                          if k not in queries.NOT_SERIES and isinstance(v, (int, float)))
        # Flush before a checkpoint is written (the engine saves after reporting the step), so a
        # crash right after the save cannot leave a hole in the metrics of the resumed run.
        at_save = self.save_steps > 0 and step % self.save_steps == 0
        last = self.total_steps is not None and step >= self.total_steps
        if at_save or last or time.monotonic() - self._last_flush >= FLUSH_EVERY_S:
            self.flush()

    def on_checkpoint(self, step: int, path: str) -> None:
        self.flush()
        self._artifacts.put(("checkpoint", path, int(step)))

    def on_best(self, step: int, path: str) -> None:
        self.flush()  # the eval metric the best was chosen by is stored before the artifact
        self._artifacts.put(("best", path, int(step)))

    def on_log(self, message: str) -> None:
        print(f"[engine] {message}", flush=True)

    def on_end(self, status: str, error: str | None = None) -> None:
        self.flush()

    def should_stop(self) -> str | None:
        now = time.monotonic()
        if self._stop is None and now - self._last_poll >= STOP_POLL_S:
            self._last_poll = now
            with session() as s:
                self._stop = s.scalar(select(Job.stop_request).where(Job.id == self.job_id))
        stop = self._stop or ("pause" if self.terminated else None)
        if stop:
            self.flush()  # the checkpoint that follows must not outrun the metrics
        return stop

    def flush(self) -> None:
        rows, self._rows = self._rows, []
        self._last_flush = time.monotonic()
        queries.write_metrics(self.job_id, rows)

    def close(self) -> None:
        """Flush, and wait for pending checksums."""
        self.flush()
        self._artifacts.put(None)
        self._hasher.join()

    def _hash_loop(self) -> None:
        while (item := self._artifacts.get()) is not None:
            kind, path, step = item
            try:
                if Path(path).exists():
                    queries.record_artifact(self.job_id, kind, path, step)
            except Exception as exc:  # noqa: BLE001 - a checksum must never kill training
                print(f"[jobs] could not record artifact {path}: {exc}", flush=True)


class Heartbeat(threading.Thread):
    """Stamps `heartbeat_at` every HEARTBEAT_S while the job is running under this pid."""

    def __init__(self, job_id: int, pid: int) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.job_id, self.pid = job_id, pid
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            try:
                with session(immediate=True) as s:
                    s.execute(update(Job).where(Job.id == self.job_id, Job.pid == self.pid,
                                                Job.status == RUNNING).values(heartbeat_at=time.time()))
            except Exception as exc:  # noqa: BLE001 - a busy database must not end the thread
                print(f"[jobs] heartbeat failed: {exc}", flush=True)


def _register(job_id: int, pid: int) -> Job | None:
    """Record our pid on the job and return it; None when the job is not ours to run (it was
    settled or another worker holds it)."""
    with session(immediate=True) as s:
        job = s.get(Job, job_id)
        if job is None or job.status != RUNNING or job.pid not in (None, pid):
            return None
        job.pid, job.heartbeat_at = pid, time.time()
        return job


def _guarded(work: Callable[[], tuple[str, str | None]]) -> tuple[str, str | None]:
    """Run the job's work; returns (status, error). Errors become `failed` with a message the
    user can act on (a KestrelError's own text: out of memory says what to lower)."""
    try:
        status, error = work()
    except KestrelError as exc:
        traceback.print_exc()
        return FAILED, str(exc)
    except Exception as exc:  # noqa: BLE001 - any engine crash must end as `failed`, not hang
        traceback.print_exc()
        return FAILED, f"{type(exc).__name__}: {exc} (the job log has the traceback)"
    if status not in RESULT_STATUSES:
        return FAILED, f"the engine returned an unknown status {status!r}"
    return status, error


def _train(job_id: int, pid: int, config: dict[str, Any]) -> tuple[str, str | None]:
    """Run the training engine with a DbCallback, then record what it left in its folder."""
    callback = DbCallback(job_id, pid, save_steps=int(config.get("save_steps") or 0))
    signal.signal(signal.SIGTERM, lambda *_: setattr(callback, "terminated", True))

    group = device_group(env.raw("KESTREL_JOB_DEVICE"))
    if len(group) > 1:  # the runner made exactly the group's GPUs visible, numbered from 0
        config = {**config, "devices": len(group)}

    def engine() -> tuple[str, str | None]:
        result = resolve_entry()(config_from_dict(config), callbacks=[callback])
        return getattr(result, "status", COMPLETED), getattr(result, "error", None)

    status, error = _guarded(engine)
    try:
        callback.close()
        record_outputs(job_id, config["output_dir"])
    except Exception as exc:  # noqa: BLE001 - bookkeeping must not hide the run's result
        print(f"[jobs] could not record outputs: {exc}", flush=True)
    if status == INTERRUPTED and error is None and callback.terminated:
        error = "stopped by SIGTERM; resume continues from the last checkpoint"
    return status, error


def record_outputs(job_id: int, output_dir: str) -> None:
    """Record what the run left in its folder (adapter, merged model, checkpoints, logs, config)
    and forget rows of files that are gone (the engine keeps only the newest checkpoints)."""
    root = Path(output_dir)
    if not root.is_dir():
        return
    known = {a.path for a in queries.list_artifacts(job_id, "checkpoint")}
    for path in sorted(root.iterdir()):
        if path.is_dir() and path.name == "checkpoints":
            for ckpt in sorted(path.glob("step-*[0-9]")):  # not step-N.tmp: never completed
                if str(ckpt) not in known:  # already hashed when it was written
                    queries.record_artifact(job_id, "checkpoint", ckpt, int(ckpt.name[5:]))
        elif path.is_dir() and path.name == BEST_DIR:
            if (best := read_best(root)) is not None:  # no marker: a half-written best, not listed
                queries.record_artifact(job_id, "best", path, int(best["step"]))
        elif (kind := _artifact_kind(path)) is not None:
            queries.record_artifact(job_id, kind, path)
    queries.prune_artifacts(job_id)


def _artifact_kind(path: Path) -> str | None:
    if path.is_dir():
        if (path / "adapter_config.json").exists():
            return "adapter"
        return "model" if (path / "config.json").exists() else None
    return {".gguf": "gguf", ".log": "log", ".txt": "log", ".jsonl": "metrics", ".csv": "metrics",
            ".yaml": "config", ".yml": "config"}.get(path.suffix.lower())


def run_job(job_id: int) -> int:
    """Run one claimed job to its end; returns the process exit code."""
    pid = os.getpid()
    job = _register(job_id, pid)
    if job is None:
        print(f"[jobs] job {job_id} is not waiting for this worker (pid {pid}); exiting", flush=True)
        return 2
    heartbeat = Heartbeat(job_id, pid)
    heartbeat.start()
    quiet_progress_bars()
    try:
        if job.kind == EXPORT:
            status, error = _guarded(lambda: export_job.run(job_id, dict(job.config), job.device or "cpu"))
            _record_log(job)
        else:
            status, error = _train(job_id, pid, dict(job.config))
    finally:
        heartbeat.stopped.set()
    print(f"[jobs] job {job_id} {status}" + (f": {error}" if error else ""), flush=True)
    if not _write_result(job_id, pid, status, error):
        return NO_RESULT_EXIT  # its supervisor records that it ended without a stored result
    return 0 if status != FAILED else 1


def quiet_progress_bars() -> None:
    """A job's log is a file read in the Runs tab: progress bars redrawn with carriage returns
    (weights loading, shards writing, dataset maps) would only be noise there, as would
    bitsandbytes' warning that an optional CPU kernel package is missing (set before its import)."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import datasets
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    disable_progress_bars()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()


def _write_result(job_id: int, pid: int, status: str, error: str | None) -> bool:
    """Store the job's result. A database that cannot be written (a full disk: a failed
    checkpoint has just given its space back, or another program may) is retried for
    RESULT_RETRY_S; False when it never could be, after saying so in the log."""
    deadline = time.monotonic() + RESULT_RETRY_S
    while True:
        try:
            with session(immediate=True) as s:
                s.execute(update(Job).where(Job.id == job_id, Job.pid == pid, Job.status == RUNNING).values(
                    status=status, error=error, finished_at=time.time(), heartbeat_at=time.time(),
                    stop_request=None))
            return True
        except StoreWriteError as exc:
            if time.monotonic() > deadline:
                print(f"[jobs] could not record the result of job {job_id}: {exc}", flush=True)
                return False
            time.sleep(1.0)


def _record_log(job: Job) -> None:
    """An export's log as an artifact (training's is found in its folder by record_outputs), and
    no rows of files that are gone."""
    try:
        if job.log_path and Path(job.log_path).is_file():
            queries.record_artifact(job.id, "log", job.log_path)
        queries.prune_artifacts(job.id)
    except Exception as exc:  # noqa: BLE001 - bookkeeping must not hide the job's result
        print(f"[jobs] could not record the log: {exc}", flush=True)


def lower_priority(device: str | None) -> bool:
    """Renice a job on the CPU by CPU_NICE, so the studio (and the desktop) stay responsive on a
    small machine while it trains or exports; True when done. Called before any thread starts:
    Linux niceness belongs to each thread, and a new thread inherits its creator's."""
    if device != "cpu":
        return False
    try:
        os.nice(CPU_NICE)
    except (AttributeError, OSError) as exc:  # no os.nice (Windows) or not permitted: run as is
        print(f"[jobs] could not lower the priority: {exc}", flush=True)
        return False
    _lower_autogroup()
    return True


def autogroup_nice(pid: int | str = "self") -> int | None:
    """The nice value of `pid`'s autogroup (its session, as the scheduler ranks it against other
    sessions), or None when it has none of its own: not Linux, a kernel without autogroup, or a
    process still in the default group (its session not started by setsid since boot, as in many
    containers), where the file reads empty and the group's nice cannot be set. A new session
    gets a group of its own; inside a cgroup of its own the scheduler ignores it, harmlessly."""
    try:
        text = Path(f"/proc/{pid}/autogroup").read_text()
    except OSError:
        return None
    _, sep, nice = text.partition(" nice ")
    return int(nice) if sep else None


def _lower_autogroup() -> None:
    """With Linux's autogroup scheduling (on by default on desktops) CPU time is shared between
    sessions first, and a thread's nice value only ranks it inside its own session: the worker
    runs in a session of its own (start_new_session), so `os.nice` alone left it an equal share
    beside the studio. The session's own nice value ranks it against the others. The supervisor
    shares the session but only waits; the next job it launches starts a new session at 0."""
    if autogroup_nice() is None:  # no group of its own: plain nice values already rank it
        return
    try:
        Path("/proc/self/autogroup").write_text(str(CPU_NICE))
    except OSError as exc:
        print(f"[jobs] could not lower the session's priority: {exc}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m kestrel.jobs.worker JOB_ID", file=sys.stderr)
        return 2
    job_id = int(args[0])
    try:
        worker_pid = supervisor.fork_worker()  # before any thread starts (see kestrel.jobs.supervisor)
    except OSError as exc:
        runner.fail_launch(job_id, f"could not start the worker: {exc}")
        return 1
    if worker_pid != 0:
        return supervisor.supervise(job_id, worker_pid)
    # Only the worker is reniced: the supervisor starts the next job once this one has exited, and
    # a process can raise its children's niceness but never lower it again, so a reniced launcher
    # would pass a CPU job's low priority on to the GPU job after it.
    lower_priority(env.raw("KESTREL_JOB_DEVICE") or None)
    return run_job(job_id)


if __name__ == "__main__":
    sys.exit(main())
