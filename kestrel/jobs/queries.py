"""Read and write queries over the job store: what the charts, the command line and the worker use.

Metric rows come back in long format, `MetricPoint(step, name, value, time)`, the shape a
DataFrame for `gr.LinePlot(x="step", y="value", color="name")` wants.
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import and_, delete, func, select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from kestrel.jobs.models import Artifact, Dataset, Job, Metric
from kestrel.jobs.store import require_job, session

# Metrics the engine reports that are not series of their own.
NOT_SERIES = ("step", "total_steps")


class MetricPoint(NamedTuple):
    step: int
    name: str
    value: float
    time: float


def _point(step: int, name: str, value: float | None, at: float) -> MetricPoint:
    return MetricPoint(int(step), name, math.nan if value is None else float(value), float(at))


# ---------------------------------------------------------------------------------------------
# Jobs


def list_jobs(status: str | None = None, limit: int | None = None, kind: str | None = None) -> list[Job]:
    """Jobs, newest first, as detached rows (their columns stay readable after the session)."""
    with session() as s:
        q = select(Job).order_by(Job.id.desc())
        if status:
            q = q.where(Job.status == status)
        if kind:
            q = q.where(Job.kind == kind)
        if limit:
            q = q.limit(limit)
        return list(s.scalars(q))


def get_job(job_id: int) -> Job:
    """One job; raises JobError naming the id when there is none."""
    with session() as s:
        return require_job(s, job_id)


def job_summary(job: Job, with_metrics: bool = False) -> dict[str, Any]:
    """The JSON shape of `list --json` / `show --json` (and what the studio's table shows)."""
    total = job.total_steps
    out: dict[str, Any] = {
        "id": job.id, "name": job.name, "kind": job.kind, "status": job.status, "pid": job.pid,
        "device": job.device, "step": job.step, "total_steps": total,
        "progress": (job.step / total) if total else None, "stage": job.stage, "error": job.error,
        "created_at": job.created_at, "started_at": job.started_at, "finished_at": job.finished_at,
        "heartbeat_at": job.heartbeat_at, "output_dir": job.output_dir, "log_path": job.log_path,
        "stop_request": job.stop_request, "attempts": job.attempts,
    }
    if with_metrics:
        out["last_metrics"] = latest_metrics(job.id)
        out["artifacts"] = [a.as_dict() for a in list_artifacts(job.id)]
        out["config"] = job.config
    return out


# ---------------------------------------------------------------------------------------------
# Metrics


def write_metrics(job_id: int, rows: list[tuple[int, str, float]], at: float | None = None,
                  stage: str | None = None) -> None:
    """Store (step, name, value) rows and advance the job's step, in one transaction.

    Readers therefore never see a step with only some of its metrics, nor `job.step` ahead of
    the metrics. A row that exists is overwritten (upsert), so a retried batch cannot duplicate.
    `stage` (an export's "writing f16 GGUF") is stored on the job in the same transaction.
    """
    if not rows:
        return
    at = time.time() if at is None else at
    values = [{"job_id": job_id, "step": step, "name": name, "value": None if math.isnan(v) else v,
               "time": at} for step, name, v in rows]
    stmt = sqlite_insert(Metric).values(values)
    stmt = stmt.on_conflict_do_update(index_elements=["job_id", "step", "name"],
                                      set_={"value": stmt.excluded.value, "time": stmt.excluded.time})
    top = max(step for step, _, _ in rows)
    with session(immediate=True) as s:
        s.execute(stmt)
        s.execute(update(Job).where(Job.id == job_id, Job.step < top).values(step=top))
        s.execute(update(Job).where(Job.id == job_id).values(
            heartbeat_at=at, **({"stage": stage[:200]} if stage is not None else {})))


def truncate_metrics(job_id: int, after_step: int) -> int:
    """Drop rows past `after_step` (a resumed run repeats them from its checkpoint)."""
    with session(immediate=True) as s:
        n = s.execute(delete(Metric).where(Metric.job_id == job_id, Metric.step > after_step)).rowcount
        s.execute(update(Job).where(Job.id == job_id).values(step=after_step))
        return n


def metrics_after(job_id: int, step: int = 0, names: list[str] | None = None,
                  limit: int = 100_000) -> list[MetricPoint]:
    """Every row with step > `step`, in step order: what a poller asks for every second or two.

    A resumed run replaces the rows past its checkpoint: when `job.attempts` changes, a poller
    should read again from 0 (or from the job's current `step`).
    """
    q = select(Metric.step, Metric.name, Metric.value, Metric.time).where(
        Metric.job_id == job_id, Metric.step > step)
    if names:
        q = q.where(Metric.name.in_(names))
    with session() as s:
        rows = s.execute(q.order_by(Metric.step, Metric.name).limit(limit)).all()
    return [_point(*r) for r in rows]


def metric_series(job_id: int, names: list[str] | None = None, max_points: int = 1000) -> list[MetricPoint]:
    """Each named series (all when `names` is None) with at most `max_points` points.

    A longer series is cut into `max_points` buckets of equal step width; a bucket becomes one
    point at its last step with the mean of its values (the noise of per-step loss averages out,
    the trend stays). Empty buckets give no point. Done in SQL so a 100k-step run never leaves
    the database whole.
    """
    max_points = max(2, int(max_points))
    base = [Metric.job_id == job_id] + ([Metric.name.in_(names)] if names else [])
    with session() as s:
        spans = s.execute(select(Metric.name, func.count(), func.min(Metric.step), func.max(Metric.step))
                          .where(*base).group_by(Metric.name).order_by(Metric.name)).all()
        out: list[MetricPoint] = []
        for name, count, lo, hi in spans:
            where = and_(Metric.job_id == job_id, Metric.name == name)
            if count <= max_points:
                rows = s.execute(select(Metric.step, Metric.name, Metric.value, Metric.time)
                                 .where(where).order_by(Metric.step)).all()
            else:
                # bucket = (step - lo) * max_points // (hi - lo + 1), in 0 .. max_points - 1.
                bucket = ((Metric.step - lo) * max_points // (hi - lo + 1)).label("bucket")
                rows = s.execute(select(func.max(Metric.step), Metric.name, func.avg(Metric.value),
                                        func.max(Metric.time)).where(where)
                                 .group_by(bucket).order_by(bucket)).all()
            out.extend(_point(*r) for r in rows)
    return out


def attempt_start_step(job_id: int, since: float) -> int:
    """The step the job's current attempt (started at `since`) resumed from: its newest checkpoint
    recorded before then, 0 for a first run. Read from the small artifacts table, so the studio
    may ask at every poll."""
    with session() as s:
        step = s.scalar(select(func.max(Artifact.step)).where(
            Artifact.job_id == job_id, Artifact.kind == "checkpoint", Artifact.created_at < since))
    return int(step or 0)


def latest_metrics(job_id: int) -> dict[str, float]:
    """The most recent value of each metric of a job (its latest step for that name)."""
    last = (select(Metric.name, func.max(Metric.step).label("step"))
            .where(Metric.job_id == job_id).group_by(Metric.name).subquery())
    q = select(Metric.name, Metric.value).join(
        last, and_(Metric.name == last.c.name, Metric.step == last.c.step)).where(Metric.job_id == job_id)
    with session() as s:
        return {name: math.nan if v is None else v for name, v in s.execute(q).all()}


# ---------------------------------------------------------------------------------------------
# Artifacts and datasets


def checksum(path: str | Path) -> tuple[int, str]:
    """(size in bytes, sha256) of a file, or of a folder: every file in sorted relative-path
    order, each hashed as its path, a NUL byte, then its content."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest, size = hashlib.sha256(), 0
    for f in files:
        if f != root:
            digest.update(f.relative_to(root).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
    return size, digest.hexdigest()


def record_artifact(job_id: int, kind: str, path: str | Path, step: int | None = None) -> None:
    """Add or refresh the row for `path` with its current size and checksum."""
    size, digest = checksum(path)
    values = {"job_id": job_id, "kind": kind, "path": str(path), "step": step,
              "size_bytes": size, "checksum": digest, "created_at": time.time()}
    stmt = sqlite_insert(Artifact).values(values)
    stmt = stmt.on_conflict_do_update(index_elements=["job_id", "path"], set_={
        k: stmt.excluded[k] for k in ("kind", "step", "size_bytes", "checksum", "created_at")})
    with session(immediate=True) as s:
        s.execute(stmt)


def prune_artifacts(job_id: int) -> int:
    """Forget artifacts whose files are gone (the engine rotates old checkpoints)."""
    with session(immediate=True) as s:
        gone = [a.id for a in s.scalars(select(Artifact).where(Artifact.job_id == job_id))
                if not Path(a.path).exists()]
        if gone:
            s.execute(delete(Artifact).where(Artifact.id.in_(gone)))
        return len(gone)


def list_artifacts(job_id: int, kind: str | None = None) -> list[Artifact]:
    with session() as s:
        q = select(Artifact).where(Artifact.job_id == job_id)
        if kind:
            q = q.where(Artifact.kind == kind)
        return list(s.scalars(q.order_by(Artifact.step, Artifact.path)))


def add_dataset(path: str | Path, name: str | None = None, format: str | None = None,
                rows: int | None = None, token_stats: dict[str, Any] | None = None,
                columns: dict[str, str] | None = None) -> int:
    """Register a dataset file (or update its row): the studio passes what it detected, and the
    column mapping the user chose (`columns`; {} forgets a saved one, None keeps it).

    Size, file type and checksum are computed here; registering the same path again refreshes it.
    """
    p = Path(path).expanduser().resolve()
    size, digest = checksum(p)
    values = {"name": name or p.stem, "path": str(p), "format": format, "rows": rows,
              "file_type": p.suffix.lstrip(".").lower() or None, "size_bytes": size,
              "checksum": digest, "token_stats": token_stats, "created_at": time.time(),
              "columns": dict(columns) if columns is not None else None}
    with session(immediate=True) as s:
        row = s.scalar(select(Dataset).where(Dataset.path == str(p)))
        if row is None:
            row = Dataset(**values)
            s.add(row)
        else:
            for key, value in values.items():
                if value is not None and key != "created_at":
                    setattr(row, key, value)
        s.flush()
        return row.id


def list_datasets() -> list[Dataset]:
    with session() as s:
        return list(s.scalars(select(Dataset).order_by(Dataset.id.desc())))


def saved_mapping(path: str | Path) -> tuple[str, dict[str, str]] | None:
    """(format, role -> column) the user saved for the dataset at `path`, or None when it has
    none (not registered, or its columns were detected)."""
    p = Path(path).expanduser()
    if not p.is_file():
        return None
    with session() as s:
        row = s.scalar(select(Dataset).where(Dataset.path == str(p.resolve())))
        if row is None or not row.columns or not row.format:
            return None
        return row.format, dict(row.columns)


def apply_saved_mapping(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a training config dict) with its dataset's saved format and column mapping, when
    it names neither (`dataset_format: auto`, no `columns`): a job started from the command line
    reads the file as the studio showed it."""
    if config.get("dataset_format", "auto") != "auto" or config.get("columns"):
        return config
    saved = saved_mapping(str(config.get("dataset", "")))
    if saved is None:
        return config
    return {**config, "dataset_format": saved[0], "columns": saved[1]}
