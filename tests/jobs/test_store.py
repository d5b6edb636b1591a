"""The store on its own (no worker processes): schema, upgrade, sessions, queries, the claim."""

from __future__ import annotations

import inspect
import math
import sqlite3
import threading
from pathlib import Path

import pytest
from sqlalchemy import select, text

from kestrel.errors import KestrelError
from kestrel.jobs import queries, store
from kestrel.jobs.models import QUEUED, RUNNING, SCHEMA_VERSION, Job, Metric


def _add_job(status: str = QUEUED, **kw: object) -> int:
    with store.session(immediate=True) as s:
        job = Job(**{"config": {"model": "demo"}, "output_dir": "/tmp/x", "status": status, **kw})
        s.add(job)
        s.flush()
        return job.id


def test_new_database_is_wal_with_busy_timeout_and_current_version(kestrel_home: Path) -> None:
    with store.session() as s:
        assert s.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert s.execute(text("PRAGMA busy_timeout")).scalar() == 30000
        assert s.execute(text("PRAGMA foreign_keys")).scalar() == 1
    assert store.db_path() == kestrel_home / "kestrel.db" and store.db_path().exists()
    assert store.schema_version() == SCHEMA_VERSION


def test_session_commits_on_success_and_rolls_back_on_error() -> None:
    kept = _add_job()
    with pytest.raises(RuntimeError):
        with store.session(immediate=True) as s:
            s.add(Job(config={}, output_dir="/tmp/y"))
            s.flush()
            raise RuntimeError("boom")
    assert [j.id for j in queries.list_jobs()] == [kept]


def _write_old_database(path: Path) -> None:
    """A database as an earlier Kestrel wrote it: no schema_version, artifacts or datasets
    tables, jobs without several columns, metrics without the series index."""
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE jobs (id INTEGER PRIMARY KEY, name VARCHAR(200), kind VARCHAR(20) NOT NULL,
            config JSON NOT NULL, status VARCHAR(20) NOT NULL, device VARCHAR(40), pid INTEGER,
            created_at FLOAT NOT NULL, started_at FLOAT, finished_at FLOAT, heartbeat_at FLOAT,
            error TEXT, output_dir TEXT NOT NULL, step INTEGER NOT NULL, total_steps INTEGER);
        CREATE TABLE metrics (id INTEGER PRIMARY KEY, job_id INTEGER NOT NULL REFERENCES jobs(id),
            step INTEGER NOT NULL, name VARCHAR(80) NOT NULL, value FLOAT, time FLOAT NOT NULL,
            CONSTRAINT uq_metrics_job_step_name UNIQUE (job_id, step, name));
        INSERT INTO jobs VALUES (7, 'old', 'sft', '{"model": "demo"}', 'completed', 'cpu', 11,
            1.0, 2.0, 3.0, 3.0, NULL, '/tmp/old', 3, 3);
        INSERT INTO metrics (job_id, step, name, value, time) VALUES
            (7, 1, 'loss', 3.0, 1.5), (7, 2, 'loss', 2.0, 1.6), (7, 3, 'loss', 1.0, 1.7);
    """)
    con.commit()
    con.close()


def test_older_database_upgrades_in_place_without_loss(kestrel_home: Path) -> None:
    _write_old_database(kestrel_home / "kestrel.db")
    store.reset_engines()
    assert store.schema_version() == SCHEMA_VERSION
    old = queries.get_job(7)
    assert (old.name, old.status, old.step, old.config) == ("old", "completed", 3, {"model": "demo"})
    assert old.attempts == 0 and old.stop_request is None  # new columns, filled with defaults
    assert [p.value for p in queries.metrics_after(7, 0)] == [3.0, 2.0, 1.0]
    with store.session() as s:
        indexes = {row[1] for row in s.execute(text("PRAGMA index_list(metrics)"))}
    assert "ix_metrics_job_name_step" in indexes
    queries.record_artifact(7, "log", kestrel_home / "kestrel.db.bak-v0")  # a new table works
    backup = sqlite3.connect(kestrel_home / "kestrel.db.bak-v0")
    assert backup.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == 3
    backup.close()
    assert _add_job() == 8


def test_database_from_a_newer_version_is_refused(kestrel_home: Path) -> None:
    _add_job()
    with store.session(immediate=True) as s:
        s.execute(text("UPDATE schema_version SET version = :v"), {"v": SCHEMA_VERSION + 1})
    store.reset_engines()
    with pytest.raises(KestrelError, match="newer Kestrel"):
        store.get_engine()
    con = sqlite3.connect(kestrel_home / "kestrel.db")  # the file was left untouched
    assert con.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 1
    con.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
    con.commit()
    con.close()


def test_write_metrics_is_an_upsert_that_advances_the_step_and_keeps_nan() -> None:
    job_id = _add_job(RUNNING)
    queries.write_metrics(job_id, [(1, "loss", 2.0), (1, "lr", 0.1), (2, "loss", 1.5)])
    queries.write_metrics(job_id, [(2, "loss", 1.25), (3, "loss", math.nan)])  # step 2 again
    assert queries.get_job(job_id).step == 3
    rows = [(p.step, p.name, p.value) for p in queries.metrics_after(job_id, 0)]
    assert rows[:3] == [(1, "loss", 2.0), (1, "lr", 0.1), (2, "loss", 1.25)]
    assert rows[3][:2] == (3, "loss") and math.isnan(rows[3][2])
    assert [p.step for p in queries.metrics_after(job_id, 1, names=["loss"])] == [2, 3]
    assert queries.truncate_metrics(job_id, 1) == 2
    assert queries.get_job(job_id).step == 1 and queries.latest_metrics(job_id) == {"loss": 2.0, "lr": 0.1}


def test_metric_series_downsamples_long_runs_into_bucket_means() -> None:
    job_id = _add_job(RUNNING)
    queries.write_metrics(job_id, [(s, "loss", float(s)) for s in range(1, 1001)]
                          + [(s, "lr", 0.5) for s in range(1, 1001)] + [(500, "eval_loss", 4.0)])
    series = queries.metric_series(job_id, ["loss", "lr"], max_points=10)
    loss = [(p.step, p.value) for p in series if p.name == "loss"]
    # Ten buckets of 100 steps; each point sits at its bucket's last step with the bucket mean.
    assert loss == [(100 * (i + 1), 100 * i + 50.5) for i in range(10)]
    assert [p.value for p in series if p.name == "lr"] == [0.5] * 10
    short = queries.metric_series(job_id, max_points=2000)
    assert len(short) == 2001 and [p.step for p in short if p.name == "eval_loss"] == [500]
    assert queries.latest_metrics(job_id) == {"eval_loss": 4.0, "loss": 1000.0, "lr": 0.5}


def test_claim_respects_device_slots_requests_and_queue_order() -> None:
    first = _add_job(queued_at=1.0)
    pinned = _add_job(queued_at=2.0, requested_device="cuda:1")
    third = _add_job(queued_at=3.0)
    assert store.claim_next(["cuda:0", "cuda:1"]) == (first, "cuda:0")
    assert store.claim_next(["cuda:0", "cuda:1"]) == (pinned, "cuda:1")
    assert store.claim_next(["cuda:0", "cuda:1"]) is None  # both busy: the third waits
    assert store.claim_next(["cuda:0", "cuda:1"], slots=2) == (third, "cuda:0")
    claimed = queries.get_job(first)
    assert claimed.status == RUNNING and claimed.attempts == 1 and claimed.heartbeat_at is not None


def test_a_run_on_several_gpus_holds_them_all() -> None:
    """`devices: 2` claims two free GPUs at once as one group; while it runs neither GPU takes
    another job; a list of ids waits for exactly those GPUs; on the CPU the ranks share "cpu"."""
    gpus = ["cuda:0", "cuda:1", "cuda:2"]
    single = _add_job(queued_at=1.0)
    pair = _add_job(queued_at=2.0, config={"model": "demo", "devices": 2})
    assert store.claim_next(gpus) == (single, "cuda:0")
    assert store.claim_next(gpus) == (pair, "cuda:1,cuda:2")
    later = _add_job(queued_at=3.0)
    assert store.claim_next(gpus) is None  # every GPU busy
    with store.session(immediate=True) as s:
        s.get(Job, pair).status = "completed"
    assert store.claim_next(gpus) == (later, "cuda:1")
    chosen = _add_job(queued_at=4.0, config={"model": "demo", "devices": [0, 2]})
    assert store.claim_next(gpus) is None  # cuda:0 is still busy
    with store.session(immediate=True) as s:
        s.get(Job, single).status = "completed"
    assert store.claim_next(gpus) == (chosen, "cuda:0,cuda:2")
    on_cpu = _add_job(queued_at=5.0, config={"model": "demo", "devices": 2})
    assert store.claim_next(["cpu"]) == (on_cpu, "cpu")


def _finish(job_id: int) -> None:
    with store.session(immediate=True) as s:
        s.get(Job, job_id).status = "completed"


def test_a_waiting_group_job_is_not_overtaken_by_later_single_gpu_jobs() -> None:
    """The oldest queued job that needs 2 GPUs keeps the free one while the other is busy: later
    one-GPU jobs (pinned ones too) wait, and it starts as soon as the busy GPU frees up."""
    gpus = ["cuda:0", "cuda:1"]
    first = _add_job(queued_at=1.0)
    assert store.claim_next(gpus) == (first, "cuda:0")
    pair = _add_job(queued_at=2.0, config={"model": "demo", "devices": 2})
    later = _add_job(queued_at=3.0)
    pinned = _add_job(queued_at=4.0, requested_device="cuda:1")
    assert store.claim_next(gpus) is None  # cuda:1 is free but kept for the pair
    _finish(first)
    assert store.claim_next(gpus) == (pair, "cuda:0,cuda:1")
    assert store.claim_next(gpus) is None
    _finish(pair)
    assert store.claim_next(gpus) == (later, "cuda:0")
    assert store.claim_next(gpus) == (pinned, "cuda:1")


def test_a_waiting_group_holds_only_the_gpus_it_needs() -> None:
    """A job waiting for GPUs 0 and 1 keeps the free cuda:1; a later job still starts on cuda:2,
    which it does not need. `devices: auto` (every GPU) keeps every free one."""
    gpus = ["cuda:0", "cuda:1", "cuda:2"]
    first = _add_job(queued_at=1.0)
    assert store.claim_next(gpus) == (first, "cuda:0")
    listed = _add_job(queued_at=2.0, config={"model": "demo", "devices": [0, 1]})
    backfill = _add_job(queued_at=3.0)
    blocked = _add_job(queued_at=4.0)
    assert store.claim_next(gpus) == (backfill, "cuda:2")
    assert store.claim_next(gpus) is None  # cuda:1 is kept for the listed pair
    _finish(first)
    assert store.claim_next(gpus) == (listed, "cuda:0,cuda:1")
    _finish(listed)
    _finish(backfill)
    every = _add_job(queued_at=5.0, config={"model": "demo", "devices": "auto"})
    assert store.claim_next(gpus) == (blocked, "cuda:0")  # older than the auto job
    _add_job(queued_at=6.0)
    assert store.claim_next(gpus) is None  # cuda:1 and cuda:2 kept for the auto job
    _finish(blocked)
    assert store.claim_next(gpus) == (every, "cuda:0,cuda:1,cuda:2")


def test_a_group_larger_than_the_machine_holds_nothing_back() -> None:
    """A job asking for more GPUs than jobs may use can never start: it must not keep the free
    GPUs from the jobs behind it."""
    gpus = ["cuda:0", "cuda:1"]
    _add_job(queued_at=1.0, config={"model": "demo", "devices": 4})
    later = _add_job(queued_at=2.0)
    assert store.claim_next(gpus) == (later, "cuda:0")


def test_concurrent_claims_never_double_book_a_device() -> None:
    for i in range(5):
        _add_job(queued_at=float(i))
    results: list[tuple[int, str] | None] = []
    barrier = threading.Barrier(8)

    def claim() -> None:
        barrier.wait()
        results.append(store.claim_next(["cuda:0", "cuda:1"]))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if r is not None]
    assert sorted(device for _, device in won) == ["cuda:0", "cuda:1"]
    assert len({job_id for job_id, _ in won}) == 2
    assert len(queries.list_jobs(status=RUNNING)) == 2


def test_datasets_register_and_refresh(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a"}\n{"text": "b"}\n')
    first = queries.add_dataset(data, format="text", rows=2, token_stats={"total": 4, "max": 2})
    data.write_text('{"text": "a"}\n')
    again = queries.add_dataset(data, rows=1)
    assert first == again
    (row,) = queries.list_datasets()
    assert (row.name, row.format, row.file_type, row.rows, row.size_bytes) == ("train", "text", "jsonl", 1, 14)
    assert row.token_stats == {"total": 4, "max": 2} and len(row.checksum) == 64


def test_folder_checksum_covers_names_and_contents(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w.bin").write_bytes(b"x" * 10)
    (tmp_path / "a" / "c.json").write_text("{}")
    size, first = queries.checksum(tmp_path / "a")
    assert size == 12 and queries.checksum(tmp_path / "a") == (12, first)
    (tmp_path / "a" / "c.json").rename(tmp_path / "a" / "d.json")
    assert queries.checksum(tmp_path / "a")[1] != first


def test_db_callback_implements_the_engine_callback_interface() -> None:
    from kestrel.training.metrics import Callback
    from kestrel.jobs.worker import DbCallback

    for name, method in inspect.getmembers(Callback, inspect.isfunction):
        if not name.startswith("_"):
            ours = getattr(DbCallback, name)
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(method).parameters)


def test_metrics_table_has_unique_step_name_per_job() -> None:
    job_id = _add_job(RUNNING)
    with pytest.raises(Exception, match="UNIQUE"):
        with store.session(immediate=True) as s:
            s.add_all([Metric(job_id=job_id, step=1, name="loss", value=1.0, time=0.0),
                       Metric(job_id=job_id, step=1, name="loss", value=2.0, time=0.0)])
    with store.session() as s:
        assert s.scalars(select(Metric)).all() == []


def _best_run(folder: Path, step: int, complete: bool = True) -> Path:
    """A run folder whose best/ holds an adapter (and its marker unless `complete` is False)."""
    (folder / "best" / "adapter").mkdir(parents=True)
    (folder / "best" / "adapter" / "adapter_config.json").write_text("{}")
    if complete:
        (folder / "best" / "best.json").write_text(f'{{"step": {step}, "metric": "eval_loss", "value": 0.5}}')
    return folder


def test_the_best_weights_are_recorded_when_written_and_at_the_end(tmp_path: Path) -> None:
    from kestrel.jobs.worker import DbCallback, record_outputs

    run = _best_run(tmp_path / "run", 30)
    job_id = _add_job(RUNNING, output_dir=str(run))
    cb = DbCallback(job_id, 1)
    cb.on_best(20, str(run / "best"))
    cb.close()
    [best] = queries.list_artifacts(job_id, "best")
    assert (best.path, best.step) == (str(run / "best"), 20) and best.checksum
    record_outputs(job_id, str(run))  # the marker's step replaces the row's: one row for best/
    assert [(a.path, a.step) for a in queries.list_artifacts(job_id, "best")] == [(str(run / "best"), 30)]
    half = _best_run(tmp_path / "half", 10, complete=False)
    other = _add_job(RUNNING, output_dir=str(half))
    record_outputs(other, str(half))
    assert queries.list_artifacts(other, "best") == []  # no marker: weights being replaced, not listed
