"""The parent of each worker: notices a lost worker the moment it dies, with nobody watching.

`python -m kestrel.jobs.worker JOB_ID` (started by `kestrel.jobs.runner` in a new session) forks
once, before it has started any thread or touched the database: the child is the worker and
runs the job; the parent is its supervisor. The supervisor records the worker's pid, waits for
it to exit, and if the worker died without writing its job's result (SIGKILL, the kernel's
out-of-memory killer, a crash inside native code such as an abort in llama.cpp), marks the job
`interrupted` at once, naming the signal or exit code, and kills whatever the dead worker had
started. Then, however the worker ended, the device being free, it starts what is queued and exits.

Why a parent per worker. A lost worker must be noticed within seconds with nobody watching: no
studio open, no command running. Before, only `reconcile()` noticed, and only when someone
called into the job store. The options were:
- an always-on daemon: one more thing the user must start, keep running and restart after a
  reboot; Kestrel has none on purpose;
- the workers watching one another: nothing watches the last one running;
- a parent per worker (this): the kernel tells a parent the moment its child exits (waitpid),
  with the signal that ended it, so there is no polling and no delay, and nothing runs when no
  job runs. It costs one idle process per running job: no CPU, and little memory of its own,
  since it forks before the worker imports torch and shares the rest copy-on-write.
Forking rather than starting a second interpreter keeps a job's start as fast as before (a
`python -m` supervisor would first import the job store, then start the worker's interpreter).

The supervisor leads the new session, so it outlives the studio or terminal that submitted the
job, as the workers always did. The worker leads its own process group inside that session, so
the runner's stop escalation (`killpg` on the worker's pid) reaches the worker and whatever it
started (data loaders, a quantizer) but not the supervisor, which then records the outcome. A
SIGTERM sent to the supervisor is passed on to the worker (which pauses at its next step
boundary, after a checkpoint); the supervisor keeps waiting.

If the supervisor itself is gone (a machine restart, a kill of both), `reconcile()` still marks
the job `interrupted` once the worker's heartbeat is stale, at the next command or studio poll.
POSIX only, like the rest of the runner.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from kestrel.jobs import runner


def fork_worker() -> int:
    """Fork: returns 0 in the child (the worker, now leading its own process group) and the
    child's pid in the parent (the supervisor). Call before any thread is started."""
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        return 0
    try:
        os.setpgid(pid, pid)  # also here: whichever runs first, the group exists before we signal it
    except (ProcessLookupError, PermissionError):
        pass  # the child already did it (and exec'd nothing, so EACCES cannot mean otherwise)
    return pid


def _forward_sigterm(worker_pid: int) -> None:
    """SIGTERM to the supervisor goes to the worker's process group: it stops after a checkpoint."""

    def forward(_signum: int, _frame: Any) -> None:
        try:
            os.killpg(worker_pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass

    signal.signal(signal.SIGTERM, forward)


def _wait(pid: int) -> int:
    """Wait for the child `pid`; its exit code, or minus the signal that ended it (as Popen)."""
    while True:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return 0  # already reaped (cannot happen here: nothing else waits)
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            return os.waitstatus_to_exitcode(status)


def _kill_leftovers(pgid: int) -> None:
    """Whatever the dead worker started (a quantizer, data loader workers) dies with it, so the
    device is free for the next job."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def supervise(job_id: int, worker_pid: int) -> int:
    """Wait for the worker to end and settle its job if it could not; returns the worker's exit
    code (128 + the signal when a signal ended it)."""
    _forward_sigterm(worker_pid)
    try:
        runner.record_worker_pid(job_id, worker_pid)
    except Exception as exc:  # noqa: BLE001 - the worker records its pid itself too
        print(f"[jobs] could not record the worker's pid: {exc}", flush=True)
    code = _wait(worker_pid)
    try:
        _settle(job_id, worker_pid, code)
    except Exception as exc:  # noqa: BLE001 - reconcile() settles it later from the stale heartbeat
        print(f"[jobs] could not record how the worker ended ({runner.exit_description(code)}): {exc}", flush=True)
    return code if code >= 0 else 128 - code


def _settle(job_id: int, pid: int, code: int) -> None:
    """After the worker's exit: settle its job if it could not, then start what is queued. The
    next job starts here, not in the worker: only once the worker has exited is its device
    memory free, and the worker may run reniced (a CPU job), which its children would inherit."""
    status = runner.settle_exited(job_id, pid, code)
    if status is not None:
        _kill_leftovers(pid)
        print(f"[jobs] job {job_id} {status}: the worker (pid {pid}) {runner.exit_description(code)} "
              "without reporting a result", flush=True)
    try:
        runner.schedule()
    except Exception as exc:  # noqa: BLE001 - the job is settled; the next command or studio poll starts the queue
        print(f"[jobs] could not start the next job: {exc}", flush=True)
