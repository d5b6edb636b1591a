"""The job store's tables: datasets, jobs, per-step metrics, artifacts and the schema version.

Times are UNIX seconds (float, UTC): they compare directly in SQL (`heartbeat_at < now - 6`)
and need no time-zone handling. A training job's config is the plain dict of
`kestrel.config.TrainConfig` stored as JSON, so `config_from_dict(job.config)` rebuilds it exactly;
an export job's is the dict of `kestrel.jobs.export_job.ExportConfig`.

Bump `SCHEMA_VERSION` whenever a table changes; `kestrel.jobs.store` upgrades an older database in place
(new tables, columns and indexes are added; explicit steps go in `store.MIGRATIONS`).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 3  # 2: jobs.stage (what an export is doing now); 3: datasets.columns (the saved mapping)

# Job states. Only `running` has a live worker; `interrupted` and `cancelled` can be resumed.
QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED, INTERRUPTED = (
    "queued", "running", "completed", "failed", "cancelled", "interrupted")
STATUSES = (QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED, INTERRUPTED)
FINISHED = (COMPLETED, FAILED, CANCELLED, INTERRUPTED)
RESUMABLE = (INTERRUPTED, CANCELLED, FAILED)
EXPORT = "export"
KINDS = ("sft", "grpo", "preference", EXPORT)
# best: RUN/best, the weights of the best evaluation so far (step: the step evaluated)
ARTIFACT_KINDS = ("adapter", "model", "checkpoint", "best", "log", "metrics", "config", "gguf", "modelfile", "report",
                  "archive")


class Base(DeclarativeBase):
    def as_dict(self) -> dict[str, Any]:
        """The row's columns as a plain dict (JSON-ready: times are floats)."""
        return {attr.key: getattr(self, attr.key) for attr in self.__mapper__.column_attrs}


class SchemaVersion(Base):
    """One row: the version of the tables in this file (see SCHEMA_VERSION)."""

    __tablename__ = "schema_version"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    upgraded_at: Mapped[float] = mapped_column(Float, default=time.time)


class Dataset(Base):
    """A dataset file the user registered, with what the studio detected in it."""

    __tablename__ = "datasets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    path: Mapped[str] = mapped_column(Text, unique=True)
    format: Mapped[str | None] = mapped_column(String(40))  # messages | sharegpt | alpaca | ...
    file_type: Mapped[str | None] = mapped_column(String(20))  # jsonl | json | csv | parquet
    rows: Mapped[int | None] = mapped_column(Integer)
    size_bytes: Mapped[int | None] = mapped_column(Integer)
    checksum: Mapped[str | None] = mapped_column(String(80))  # sha256 of the file
    token_stats: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # e.g. {"total", "mean", "max", "p95"}
    # The role -> column mapping the user chose (e.g. {"prompt": "q", "completion": "a"}), applied
    # with `format` by every later use; None or {} when the columns were detected.
    columns: Mapped[dict[str, str] | None] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)


class Job(Base):
    """One training or export run and everything needed to supervise it."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(20), default="sft")
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(20), default=QUEUED, index=True)
    device: Mapped[str | None] = mapped_column(String(40))  # None: any free device
    requested_device: Mapped[str | None] = mapped_column(String(40))
    pid: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    queued_at: Mapped[float | None] = mapped_column(Float)  # submit or resume: queue order
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    heartbeat_at: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    output_dir: Mapped[str] = mapped_column(Text)
    log_path: Mapped[str | None] = mapped_column(Text)
    # Training: optimizer steps. Export: percent done (total_steps 100), with `stage` saying what
    # it is doing now ("writing f16 GGUF"), so every progress display works for both kinds.
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    stage: Mapped[str | None] = mapped_column(String(200))
    # "cancel" or "pause", written by whoever asks; the worker polls it at each step boundary.
    stop_request: Mapped[str | None] = mapped_column(String(10))
    stop_requested_at: Mapped[float | None] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # starts, resumes included
    dataset_id: Mapped[int | None] = mapped_column(ForeignKey("datasets.id", ondelete="SET NULL"))


class Metric(Base):
    """One value a job reported at one step (MLflow's row shape: what charts want)."""

    __tablename__ = "metrics"
    __table_args__ = (
        # Also serves "everything after step N" (job_id, step > N) with an index range scan.
        UniqueConstraint("job_id", "step", "name", name="uq_metrics_job_step_name"),
        # A single series in step order: (job_id, name) then step.
        Index("ix_metrics_job_name_step", "job_id", "name", "step"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(80))
    # SQLite stores NaN as NULL, so a diverged loss reads back as None; readers turn it into nan.
    value: Mapped[float | None] = mapped_column(Float)
    time: Mapped[float] = mapped_column(Float)


class Artifact(Base):
    """A file or folder a job produced: adapter, merged model, checkpoint, log, export."""

    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "path", name="uq_artifacts_job_path"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(20))
    path: Mapped[str] = mapped_column(Text)
    step: Mapped[int | None] = mapped_column(Integer)
    size_bytes: Mapped[int | None] = mapped_column(Integer)
    checksum: Mapped[str | None] = mapped_column(String(80))  # sha256 over the file(s)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)

