"""The job database on a full disk: writes fail with one line that says what to free, reads keep
working (read-only when SQLite cannot even open its WAL files), and nothing is a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import event, text

from kestrel import jobs
from jobkit import config
from kestrel.jobs import store
from kestrel.jobs.store import StoreWriteError

ROOT = Path(__file__).resolve().parents[2]


def test_a_database_that_cannot_grow_refuses_writes_in_one_line_and_still_reads() -> None:
    first = jobs.submit(config(), start=False)
    engine = store.get_engine()
    with store.session() as s:
        pages = s.execute(text("PRAGMA page_count")).scalar()
    event.listen(engine, "connect", lambda conn, _: conn.execute(f"PRAGMA max_page_count={pages}"))
    engine.dispose()  # new connections: at most the pages the file has now
    with pytest.raises(StoreWriteError, match="could not be written .database or disk is full") as caught:
        for _ in range(50):
            jobs.submit(config(system_prompt="x" * 4000), start=False)  # a long config row
    assert "Free disk space" in str(caught.value) and "\n" not in str(caught.value)
    assert [j.id for j in jobs.list_jobs()][-1] == first


FULL_DISK = textwrap.dedent("""
    import contextlib, io, json, sys, time
    from pathlib import Path
    from kestrel import jobs
    from kestrel.cli.jobs import main as cli
    from kestrel.jobs import runner, store
    from kestrel.jobs.models import Job

    job_id = jobs.submit({"model": "demo", "dataset": "arithmetic_chat", "max_steps": 5}, start=False)
    with store.session(immediate=True) as s:  # a worker that died: reconcile must write to settle it
        job = s.get(Job, job_id)
        job.status, job.pid, job.heartbeat_at = "running", 2 ** 22 + 7, time.time() - 100
    store.reset_engines()  # as a fresh command: no connection open, no -wal / -shm file left
    filler = Path(sys.argv[1]) / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\\0" * 65536)
                f.flush()
        except OSError:
            pass

    def command(*args):
        runner._last_refresh = 0.0
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli([*args])
        return {"args": args, "code": code, "out": out.getvalue(), "err": err.getvalue()}

    results = [command("list"), command("show", str(job_id)), command("cancel", str(job_id))]
    filler.unlink()
    store.reset_engines()
    results.append(command("list", "--json"))
    print(json.dumps(results))
""")


def test_every_command_answers_on_a_full_disk(tmp_path: Path) -> None:
    """KESTREL_HOME on a full tmpfs (an unprivileged mount namespace; skipped where not allowed)."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no unprivileged user namespaces (unshare -rm) here")
    disk = tmp_path / "disk"
    disk.mkdir()
    env = {**os.environ, "KESTREL_HOME": str(disk / "home"), "PYTHONPATH": str(ROOT)}
    shell = f'mount -t tmpfs -o size=2m tmpfs {disk} && {sys.executable} -c "$0" {disk}'
    done = subprocess.run([unshare, "-rm", "sh", "-c", shell, FULL_DISK], capture_output=True, text=True,
                          timeout=120, env=env)
    if done.returncode != 0 and "mount" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    listed, shown, cancel, after = json.loads(done.stdout.strip().splitlines()[-1])
    for result in (listed, shown):  # reads work, with a warning naming the full disk
        assert result["code"] == 0 and "Traceback" not in result["err"], result
        assert "could not be written" in result["err"] and "running" in result["out"]
    assert cancel["code"] == 1 and cancel["out"] == ""
    assert cancel["err"].startswith("error: the job database") and "Free disk space" in cancel["err"]
    assert len(cancel["err"].strip().splitlines()) == 1
    # Space freed: the next command settles the lost job.
    assert after["code"] == 0 and json.loads(after["out"])[0]["status"] == "interrupted"


def test_a_worker_that_cannot_store_its_result_says_so(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    from kestrel.jobs import runner, worker
    from kestrel.jobs.models import Job

    def full(*_: object, **__: object) -> None:
        raise StoreWriteError("the job database x could not be written (database or disk is full; 0 bytes free there)")

    monkeypatch.setattr(worker, "RESULT_RETRY_S", 0.0)
    monkeypatch.setattr(worker, "session", full)
    assert worker._write_result(1, 2, "failed", "the checkpoint could not be written") is False
    assert "could not record the result of job 1: the job database x could not be written" in capsys.readouterr().out
    # Its supervisor then settles the job, saying where the result went.
    lost = Job(id=1, pid=2, kind="sft", stop_request=None)
    status, error = runner._lost_status(lost, False, runner.exit_description(runner.NO_RESULT_EXIT))
    assert status == "interrupted" and "could not store its result, which the job log shows" in error
