"""The job store: one SQLite file (KESTREL_HOME/kestrel.db) shared by the studio, the command
line and every worker process.

    with session() as s:                 # read: a consistent snapshot of the whole database
        job = s.get(Job, 3)
    with session(immediate=True) as s:   # write: takes the write lock up front (BEGIN IMMEDIATE)
        s.add(Job(...))

Why these settings: WAL lets readers (studio charts) run while a worker writes; a busy timeout
makes writers wait their turn instead of failing; BEGIN is emitted by us because Python's sqlite3
(legacy mode) starts no transaction for SELECTs, which would let two queries of one session see
different data. Writers use BEGIN IMMEDIATE: a deferred transaction that reads and then writes
can fail at once with "database is locked" when another writer committed in between.

A write that SQLite refuses because the disk is full ("database or disk is full", "disk I/O
error") becomes a `StoreWriteError` (a KestrelError: the command line prints one line, not a
traceback) naming the file and the free space; reads keep working on a full disk.

The chart queries live in `kestrel.jobs.queries`; this file holds the connection, the schema upgrade and
the claim of a queued job.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, inspect, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from kestrel.errors import KestrelError
from kestrel.paths import kestrel_home
from kestrel.jobs.models import EXPORT, QUEUED, RUNNING, SCHEMA_VERSION, Base, Job, SchemaVersion

BUSY_TIMEOUT_S = 30.0
DISK_ERRORS = ("database or disk is full", "disk i/o error")  # SQLITE_FULL, SQLITE_IOERR

# Steps that adding tables, columns and indexes cannot express (a changed constraint, a renamed
# column, rewritten data), keyed by the version they upgrade to. Each runs inside the upgrade's
# transaction, after new columns were added.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {}


class JobError(KestrelError):
    """A job request that cannot be carried out (unknown id, wrong state)."""


class StoreWriteError(JobError):
    """The job database could not be written: its disk is full (or failing). `reason` is the
    message without the advice."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}. Free disk space (a job's checkpoints are the largest files), "
                         "then run the command again")
        self.reason = reason


def store_write_error(exc: BaseException) -> StoreWriteError | None:
    """The StoreWriteError for a database error caused by a full or failing disk, else None."""
    if not isinstance(exc, (OperationalError, sqlite3.OperationalError)):
        return None
    text = str(getattr(exc, "orig", None) or exc)
    if not any(word in text.lower() for word in DISK_ERRORS):
        return None
    path = db_path()
    try:
        free = f"{size_text(shutil.disk_usage(path.parent).free)} free there"
    except OSError:
        free = "free space unknown"
    return StoreWriteError(f"the job database {path} could not be written ({text}; {free})")


def size_text(n: float) -> str:
    """Bytes as people read them: 512 bytes, 3.4 MB, 12.0 GB."""
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def db_path() -> Path:
    return kestrel_home() / "kestrel.db"


_ENGINES: dict[tuple[str, int], Engine] = {}
_LOCK = threading.Lock()
_warned_snapshot = False
log = logging.getLogger(__name__)


def get_engine() -> Engine:
    """The engine for the current KESTREL_HOME, created and upgraded on first use.

    Keyed by process id too: a forked child must not reuse its parent's pooled connections.
    """
    key = (str(db_path()), os.getpid())
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _create(Path(key[0]))
            upgrade(engine)
            _ENGINES[key] = engine
    return engine


def reset_engines() -> None:
    """Close every pooled connection (tests switch KESTREL_HOME between cases)."""
    with _LOCK:
        for engine in _ENGINES.values():
            engine.dispose()
        _ENGINES.clear()


def _create(path: Path) -> Engine:
    engine = create_engine(
        f"sqlite:///{path}",
        connect_args={"timeout": BUSY_TIMEOUT_S, "check_same_thread": False},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (see the module docstring)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")  # with WAL: durable across process crashes
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("kestrel_begin", "DEFERRED")
        conn.exec_driver_sql("BEGIN IMMEDIATE" if mode == "IMMEDIATE" else "BEGIN")

    return engine


@contextmanager
def session(immediate: bool = False) -> Iterator[Session]:
    """A session that commits on success, rolls back on any error, and always closes.

    `immediate=True` for anything that writes. Objects stay usable after the block
    (expire_on_commit=False) as plain detached rows.
    """
    snapshot = None
    try:
        bind = get_engine()
    except OperationalError as exc:
        if (full := store_write_error(exc)) is None:
            raise
        if immediate:
            raise full from exc
        bind = snapshot = _snapshot_engine(full)  # a full disk: read what the file holds
    if immediate:
        bind = bind.execution_options(kestrel_begin="IMMEDIATE")
    s = Session(bind=bind, expire_on_commit=False)
    try:
        yield s
        s.commit()
    except BaseException as exc:
        s.rollback()
        if (full := store_write_error(exc)) is not None:
            raise full from exc
        raise
    finally:
        s.close()
        if snapshot is not None:
            snapshot.dispose()


def _snapshot_engine(cause: StoreWriteError) -> Engine:
    """The database opened read-only and immutable: no -wal or -shm file is created, so it opens
    on a full disk, where WAL mode cannot start (SQLite then says "disk I/O error"). When no
    connection is open the file holds every committed row. Logged once per process."""
    global _warned_snapshot
    if not _warned_snapshot:
        _warned_snapshot = True
        log.warning("warning: %s; reading it read-only meanwhile", cause.reason)
    return create_engine(f"sqlite:///file:{db_path()}?mode=ro&immutable=1&uri=true", poolclass=NullPool)


# ---------------------------------------------------------------------------------------------
# Schema version and in-place upgrade


def upgrade(engine: Engine) -> int:
    """Bring the database to SCHEMA_VERSION without losing rows; returns the version found.

    A new file gets every table. An older one is first copied to `kestrel.db.bak-v<N>`, then gets
    the missing tables, columns (existing rows take the column's default) and indexes, then the
    explicit MIGRATIONS steps, all in one transaction: a failed upgrade leaves the file as it was.
    """
    with engine.connect() as raw:
        conn = raw.execution_options(kestrel_begin="IMMEDIATE")
        with conn.begin():
            tables = set(inspect(conn).get_table_names())
            if "jobs" not in tables:
                Base.metadata.create_all(conn)
                _write_version(conn, SCHEMA_VERSION)
                return SCHEMA_VERSION
            found = 0
            if "schema_version" in tables:
                found = conn.scalar(select(SchemaVersion.version).order_by(SchemaVersion.id.desc())) or 0
            if found > SCHEMA_VERSION:
                raise KestrelError(
                    f"{engine.url.database} was written by a newer Kestrel (schema {found}, this one "
                    f"knows {SCHEMA_VERSION}); upgrade Kestrel or set KESTREL_HOME to another folder")
            if found == SCHEMA_VERSION:
                return found
            _backup(Path(str(engine.url.database)), found)
            Base.metadata.create_all(conn)  # only the missing tables
            _add_missing_columns(conn)
            _add_missing_indexes(conn)
            for version in range(found + 1, SCHEMA_VERSION + 1):
                if version in MIGRATIONS:
                    MIGRATIONS[version](conn)
            _write_version(conn, SCHEMA_VERSION)
            return found


def _write_version(conn: Connection, version: int) -> None:
    conn.execute(SchemaVersion.__table__.delete())
    conn.execute(SchemaVersion.__table__.insert().values(id=1, version=version, upgraded_at=time.time()))


def _backup(path: Path, version: int) -> None:
    """A consistent copy through SQLite's backup API (a file copy could miss the WAL)."""
    target = path.with_name(f"{path.name}.bak-v{version}")
    src, dst = sqlite3.connect(path), sqlite3.connect(target)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()


def _add_missing_columns(conn: Connection) -> None:
    insp = inspect(conn)
    for table in Base.metadata.sorted_tables:
        have = {c["name"] for c in insp.get_columns(table.name)}
        for col in table.columns:
            if col.name in have:
                continue
            # Added as nullable (SQLite cannot add NOT NULL without a constant default), then
            # existing rows are filled with the model's default so the ORM never reads a gap.
            col_type = col.type.compile(dialect=conn.dialect)
            conn.exec_driver_sql(f'ALTER TABLE "{table.name}" ADD COLUMN "{col.name}" {col_type}')
            default = col.default
            if default is not None and default.is_scalar:
                conn.execute(update(table).values({col.name: default.arg}))
            elif default is not None and default.is_callable:
                conn.execute(update(table).values({col.name: default.arg(None)}))


def _add_missing_indexes(conn: Connection) -> None:
    for table in Base.metadata.sorted_tables:
        for index in table.indexes:
            index.create(conn, checkfirst=True)


def schema_version() -> int:
    with session() as s:
        return s.scalar(select(SchemaVersion.version)) or 0


# ---------------------------------------------------------------------------------------------
# Jobs: the state changes that must be atomic


def require_job(s: Session, job_id: int) -> Job:
    job = s.get(Job, job_id)
    if job is None:
        raise JobError(f"no job with id {job_id}; `python -m kestrel jobs list` shows the jobs")
    return job


def claim_next(auto_devices: list[str], slots: int = 1, export_slots: int = 1) -> tuple[int, str] | None:
    """Mark the oldest queued job that can start now as running; returns (job id, device).

    Inside one BEGIN IMMEDIATE transaction, so two schedulers (the studio and a finishing worker)
    never both start a job on one device. Two lanes, counted apart (see `kestrel.jobs.runner`):
    training jobs take `slots` per device; a job that asked for a device waits for that device,
    one that did not takes the first free device of `auto_devices`. Export jobs take one of
    `export_slots`, whatever training runs, on their requested device or `_export_device`.

    Fairness: a queued job that needs several GPUs and cannot start yet holds back the free GPUs
    it waits for (`_held_for`); no later training job may take them, so it starts as soon as its
    busy GPUs free up instead of waiting behind single-GPU jobs forever. A later job may still
    start on a GPU the waiting job does not need (a GPU outside its id list).
    """
    with session(immediate=True) as s:
        running = s.execute(select(Job.kind, Job.device).where(Job.status == RUNNING)).tuples().all()
        # Read once the first statement holds the write lock: a job whose end (finished_at) freed the
        # slot recorded it before, so the job started here never seems to start before that end.
        now = time.time()
        busy = Counter(d for kind, group in running if kind != EXPORT for d in device_group(group))
        exporting = sum(1 for kind, _ in running if kind == EXPORT)

        held: set[str] = set()  # free GPUs kept for an older queued job that needs several

        def free(device: str) -> bool:
            return busy[device] < slots and device not in held

        queued = s.scalars(select(Job).where(Job.status == QUEUED).order_by(Job.queued_at, Job.id))
        for job in queued:
            if job.kind == EXPORT:
                if exporting >= export_slots:
                    continue
                device: str | None = job.requested_device or _export_device(auto_devices, busy)
            else:
                device = _training_devices(job, auto_devices, free)
                if device is None:
                    held.update(_held_for(job, auto_devices, free))
                    continue
            claimed = s.execute(
                update(Job).where(Job.id == job.id, Job.status == QUEUED).values(
                    status=RUNNING, device=device, pid=None, started_at=now, heartbeat_at=now,
                    finished_at=None, error=None, attempts=Job.attempts + 1)
            ).rowcount
            if claimed == 1:
                return job.id, str(device)
    return None


def device_group(device: str | None) -> list[str]:
    """The devices of a job's `device` column: one ("cuda:0"), or a group ("cuda:0,cuda:1")."""
    return [d for d in (device or "").split(",") if d]


def gpus_wanted(config: dict[str, Any], auto_devices: list[str]) -> int:
    """How many GPUs a training job's `devices` asks for: `auto` is every GPU jobs may use."""
    spec = config.get("devices", 1)
    gpus = [d for d in auto_devices if d != "cpu"]
    if spec == "auto":
        return max(1, len(gpus))
    return len(spec) if isinstance(spec, list) else int(spec)


def _training_devices(job: Job, auto_devices: list[str], free: Callable[[str], bool]) -> str | None:
    """The device (or comma-joined GPU group) a queued training job can start on now, or None.

    A job that asked for a device waits for it; one that wants N GPUs waits until N are free
    at once and holds them all (a CPU machine runs its N ranks on the CPU)."""
    if job.requested_device:
        return job.requested_device if free(job.requested_device) else None
    gpus = [d for d in auto_devices if d != "cpu"]
    spec = (job.config or {}).get("devices", 1)
    if isinstance(spec, list) and gpus:  # these GPUs, all free at once
        group = [f"cuda:{i}" for i in spec]
        return ",".join(group) if all(free(d) for d in group) else None
    wanted = gpus_wanted(job.config or {}, auto_devices)
    if wanted > 1 and gpus:
        idle = [d for d in gpus if free(d)]
        return ",".join(idle[:wanted]) if len(idle) >= wanted else None
    return next((d for d in auto_devices if free(d)), None)


def _held_for(job: Job, auto_devices: list[str], free: Callable[[str], bool]) -> list[str]:
    """The free GPUs a waiting training job that needs several of them will take once the rest
    free up: its listed GPUs that are free, or (a count) every free GPU, since it needs more than
    are free now. Nothing for a one-device job, or for a count larger than the GPUs jobs may use
    (it can never start, and would hold the queue back forever)."""
    gpus = [d for d in auto_devices if d != "cpu"]
    spec = (job.config or {}).get("devices", 1)
    if job.requested_device or not gpus:
        return []
    if isinstance(spec, list):
        group = [f"cuda:{i}" for i in spec]
        return [d for d in group if free(d)] if len(group) > 1 else []
    wanted = gpus_wanted(job.config or {}, auto_devices)
    return [d for d in gpus if free(d)] if 1 < wanted <= len(gpus) else []


def _export_device(auto_devices: list[str], training: Counter[str]) -> str:
    """An idle GPU (merges run tens of times faster there), else the CPU: an export never shares
    a GPU with a training job, whose memory it could exhaust."""
    return next((d for d in auto_devices if d != "cpu" and not training[d]), "cpu")


def remove_job_files(output_dir: str) -> None:
    """Delete a job's folder, refusing anything outside KESTREL_HOME (a user-chosen output_dir)."""
    path = Path(output_dir).resolve()
    home = kestrel_home().resolve()
    if home not in path.parents:
        raise JobError(f"not deleting {path}: it is outside {home}; remove it by hand if unwanted")
    shutil.rmtree(path, ignore_errors=True)
