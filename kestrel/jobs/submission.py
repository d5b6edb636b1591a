"""A submitted config made into a stored job: checked (a ConfigError names any bad key), its
relative paths made absolute (the worker runs in its output folder), and stored with its output
folder, created inside the transaction that adds the job, so a refused config stores nothing.

    sub = prepare(config, device, available_devices())
    job_id = add_job(sub, dataset_id=None)               # queued (kestrel.jobs.runner.submit)
    job_id = add_job(sub, status=RUNNING, pid=pid, ...)  # trained by its own process (kestrel.jobs.external)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import select

from kestrel.config import TrainConfig, check_output_dir, config_from_dict, expand_path
from kestrel.constants import slug
from kestrel.errors import ConfigError
from kestrel.jobs import export_job, preflight, queries
from kestrel.jobs.models import EXPORT, QUEUED, RUNNING, Job
from kestrel.jobs.store import session
from kestrel.paths import model_stem, runs_dir

LOG_NAME = "job.log"
log = logging.getLogger("kestrel.jobs")


class Submission(NamedTuple):
    """A checked config, ready to store."""

    kind: str  # sft | grpo | preference | export
    name: str
    data: dict[str, Any]  # the config as stored, its paths absolute
    root: Path  # the folder the default output folder goes in
    device: str | None  # the device the job is pinned to; None: the first free one


def prepare(config: dict[str, Any] | TrainConfig, device: str | None, available: list[str]) -> Submission:
    """`config` checked (a training config, or an export's with `kind: export`) and `device` checked
    against the `available` devices; preflight notes are logged."""
    if export_job.is_export_config(config):
        prepared = export_job.prepare(dict(config))  # type: ignore[arg-type]
        kind, name, data, root = EXPORT, prepared.name, prepared.config, export_job.exports_root()
        device = device or prepared.device
    else:
        cfg = config if isinstance(config, TrainConfig) else config_from_dict(dict(config))
        for note in preflight.check_training(cfg):
            log.info("note: %s", note)
        kind = "grpo" if cfg.method == "grpo" else "preference" if cfg.is_preference else "sft"
        name = cfg.name or f"{model_stem(str(cfg.model))}-{cfg.method}"
        data, root = queries.apply_saved_mapping(_absolute_paths(cfg.to_dict())), runs_dir()
    if device is not None and device != "cpu" and device not in available:
        raise ConfigError(f"device {device!r} is not available; choose one of {', '.join(available + ['cpu'])}")
    return Submission(kind, name, data, root, device)


def add_job(sub: Submission, *, dataset_id: int | None = None, **columns: Any) -> int:
    """Store `sub` as a job and create its output folder; returns the job's id. The job is queued
    unless `columns` (Job columns: status, pid, ...) give it another first state. A ConfigError
    when its output folder is another queued or running job's, or cannot be created."""
    with session(immediate=True) as s:
        job = Job(**{"name": sub.name, "kind": sub.kind, "config": sub.data, "status": QUEUED,
                     "requested_device": sub.device, "output_dir": "", "step": 0, "attempts": 0,
                     "queued_at": time.time(), "dataset_id": dataset_id, **columns})
        s.add(job)
        s.flush()  # assigns the id that names the default folder
        data = sub.data
        out = Path(data["output_dir"]) if data.get("output_dir") else sub.root / f"job-{job.id}-{_slug(sub.name)}"
        clash = s.scalar(select(Job.id).where(Job.output_dir == str(out), Job.status.in_((QUEUED, RUNNING))))
        if clash is not None:
            raise ConfigError(f"output_dir {out} is in use by job {clash}; choose another output_dir")
        job.output_dir = str(out)
        job.log_path = str(out / LOG_NAME)
        job.config = {**data, "output_dir": str(out)}
        job_id = job.id
        _make_output_dir(out)  # before the commit: a folder that cannot be made leaves no job behind
    return job_id


def _make_output_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"output_dir {out} cannot be created: {reason}; choose another output_dir") from None


def _absolute_paths(data: dict[str, Any]) -> dict[str, Any]:
    """Paths in a checked training config made absolute (the worker runs in its output folder)."""
    for key in ("model", "dataset"):
        path = expand_path(str(data[key]), key)
        if preflight.exists(path) and not (key == "model" and data[key] == "demo"):  # the engine's built-in
            data[key] = str(path.resolve())
    if data.get("output_dir"):
        data["output_dir"] = str(check_output_dir(data["output_dir"]))
    init_from = data.get("lora", {}).get("init_from")
    if init_from and preflight.exists(path := expand_path(init_from, "lora.init_from")):
        data["lora"]["init_from"] = str(path.resolve())
    for reward in data.get("grpo", {}).get("rewards", []):
        if reward.get("path"):
            reward["path"] = str(expand_path(reward["path"], "grpo.rewards path").resolve())
    return data


def _slug(text: str) -> str:
    return slug(text, "job", limit=60)
