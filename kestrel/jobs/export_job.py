"""Export jobs: a finished run written as a LoRA adapter, a merged model or a GGUF file, in a
worker process like training, by the engine's own `kestrel.export.export`.

    job_id = jobs.submit({"kind": "export", "source": 3, "format": "gguf", "quant": "q4_k_m"})

or as a YAML file for `python -m kestrel jobs submit EXPORT.yaml`:

    kind: export
    source: 3            # a finished run's job id, a run folder, an adapter or model folder, or demo
    checkpoint: 40       # optional, with a run: its checkpoint of that step instead of the final weights
    format: gguf         # adapter | merged | gguf
    quant: q4_k_m        # gguf: quantization type (default f16); merged: auto | bf16 | f16 | f32
    check: true          # compare the written files with the Hugging Face model
    archive: false       # adapter / merged: also one zip of the files (the studio's download)
    # output_dir: ...    # default KESTREL_HOME/exports/job-<id>-<name>/

The base model under a run's adapter is the one the run trained on (its adapter_config.json
names it, as its config.yaml does), so the export config does not repeat it.

Progress: every call of the engine's progress hook becomes a `progress` metric row (step =
percent, value = fraction) and the job's `stage` text, with `total_steps` = 100, so `job.step /
job.total_steps` is the fraction done for any reader. Stop requests are read at those calls: a
cancel raises ExportStopped inside the export, whose staging folder is then removed, so a
stopped export leaves no partial file. Every file written becomes an artifact (kind, path,
size, sha256).
"""

from __future__ import annotations

import os
import signal
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import select, update

from kestrel.constants import DEMO
from kestrel.config import check_output_dir, expand_path
from kestrel.config_values import build_checked  # names unknown keys
from kestrel.errors import ConfigError, KestrelError
from kestrel.export import FORMATS, MERGED_DTYPES, QUANT_TYPES
from kestrel.paths import kestrel_home
from kestrel.jobs import queries
from kestrel.jobs.models import CANCELLED, COMPLETED, EXPORT, INTERRUPTED, Job
from kestrel.jobs.store import JobError, session

TOTAL = 100  # an export's total_steps: its step is the percent done
WRITE_EVERY_S = 0.5  # a progress row at least this often while the stage text changes
STOP_POLL_S = 0.2  # stop requests are read at most this often
ARCHIVE_LIMIT = 2 * 2**30  # larger exports are not zipped: a browser download that size fails too often
ARCHIVED_AT = 0.95  # with `archive`, the export's own progress ends here and zipping takes the rest


@dataclass
class ExportConfig:
    """An export job's settings (the `kind: export` YAML); unknown keys are refused by name."""

    source: str | int  # a finished run's job id (3, "job:3"), a run folder, an adapter or model folder, or demo
    checkpoint: int | None = None  # with a run (id or folder): the checkpoint of this step, not the final weights
    format: str = "gguf"  # adapter (small, needs the base model) | merged (16-bit) | gguf (llama.cpp, Ollama)
    quant: str | None = None  # gguf: one of QUANT_TYPES (default f16); merged: auto | bf16 | f16 | f32
    kind: str = EXPORT
    name: str | None = None  # the job's name; default <source>-<format>[-<quant>]
    output_dir: str | None = None  # default KESTREL_HOME/exports/job-<id>-<name>/
    check: bool = True  # compare the written files with the Hugging Face model (slower, safer)
    device: str | None = None  # pin the export (cpu, cuda:1); default an idle GPU, else the CPU
    archive: bool = False  # adapter / merged: also zip the files into one download (the studio's)


class Prepared(NamedTuple):
    """A validated export config, ready for the job table."""

    config: dict[str, Any]  # ExportConfig's fields, normalised, plus source_job
    name: str
    device: str | None


def exports_root() -> Path:
    """KESTREL_HOME/exports: where export jobs write by default (and the studio serves from)."""
    return kestrel_home() / "exports"


def is_export_config(data: Any) -> bool:
    """Whether a config dict asks for an export: `kind: export`, or an export's `source` key with
    none of training's required keys (model, dataset)."""
    if not isinstance(data, dict):
        return False
    return data.get("kind") == EXPORT or ("source" in data and not {"model", "dataset"} & data.keys())


def prepare(data: dict[str, Any]) -> Prepared:
    """Validate an export config at submit time; ConfigError names what is wrong.

    A job id source becomes its run folder here (the run must be completed); a folder must exist
    and becomes absolute, since the worker runs elsewhere. What is inside it is the engine's to
    judge: an unusable folder makes the job fail with the engine's message.
    """
    cfg: ExportConfig = build_checked(ExportConfig, dict(data), "")
    if cfg.kind != EXPORT:
        raise ConfigError(f"kind must be {EXPORT} for an export config, got {cfg.kind!r}")
    if cfg.name is not None and (len(cfg.name) > 100 or not cfg.name.isprintable()):
        raise ConfigError("name must be at most 100 characters, without control characters")
    fmt = cfg.format.lower()
    if fmt not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}, got {cfg.format!r}")
    quant = _quant(fmt, cfg.quant)
    source, run_id, stem = _resolve_source(cfg.source, cfg.checkpoint)
    output_dir = str(check_output_dir(cfg.output_dir)) if cfg.output_dir else None
    config = {**asdict(cfg), "format": fmt, "quant": quant, "source": source, "source_job": run_id,
              "output_dir": output_dir}
    return Prepared(config, cfg.name or "-".join(x for x in (stem, fmt, quant) if x), cfg.device)


def _quant(fmt: str, quant: str | None) -> str | None:
    """The normalised quantization (gguf) or dtype (merged); the adapter takes none."""
    name = quant.lower() if quant else None
    if fmt == "gguf":
        name = name or "f16"
        if name not in QUANT_TYPES:
            raise ConfigError(f"quant {quant!r} is not a GGUF quantization type; choose one of {', '.join(QUANT_TYPES)}")
    elif fmt == "merged":
        name = name or "auto"
        if name not in MERGED_DTYPES:
            raise ConfigError(f"quant {quant!r} is not a merged dtype; choose one of {', '.join(MERGED_DTYPES)}")
    elif name is not None:
        raise ConfigError(f"quant applies to gguf and merged exports only; remove it for format {fmt}")
    return name


def _resolve_source(value: str | int, checkpoint: int | None = None) -> tuple[str, int | None, str]:
    """(what kestrel.export reads, the run's job id or None, a short name) of a source."""
    text = str(value).strip()
    number = text.split(":", 1)[1] if text.startswith(("job:", "run:")) else text
    if number.isascii() and number.isdigit() and len(number) <= 18:  # a job id (int64 in the store)
        try:
            job = queries.get_job(int(number))
        except JobError as exc:
            raise ConfigError(f"export source: {exc}") from exc
        if job.kind == EXPORT:
            raise ConfigError(f"job {job.id} is an export itself; give the job id of a training run")
        if checkpoint is not None:  # a checkpoint is whole whatever became of the run after it
            return _checkpoint(Path(job.output_dir), checkpoint, f"run {job.id}"), job.id, f"run-{job.id}-step{checkpoint}"
        if job.status != COMPLETED:
            raise ConfigError(f"run {job.id} is {job.status}; only completed runs can be exported "
                              "(or one of its checkpoints: set checkpoint)")
        return job.output_dir, job.id, f"run-{job.id}"
    if text == DEMO:
        if checkpoint is not None:
            raise ConfigError("checkpoint applies to a run (its job id or folder), not to the demo model")
        return DEMO, None, DEMO
    path = expand_path(text, "export source")
    try:
        path = path.resolve(strict=True)
    except (OSError, ValueError, RuntimeError):
        raise ConfigError(f"export source {path} does not exist; give a finished run's job id or folder, "
                          "an adapter or model folder, or demo") from None
    stem = path.parent.name if path.name in ("adapter", "model") else path.name
    if checkpoint is not None:
        return _checkpoint(path, checkpoint, str(path)), None, f"{stem}-step{checkpoint}"
    return str(path), None, stem


def _checkpoint(run_dir: Path, step: int, what: str) -> str:
    """The folder of `what`'s complete checkpoint of `step`; ConfigError listing those kept."""
    from kestrel.training.checkpoints import checkpoint_dir, complete_checkpoints

    folder = checkpoint_dir(run_dir, step)
    kept = [s for s, _ in complete_checkpoints(run_dir)]
    if step not in kept:
        listed = ", ".join(str(s) for s in kept) or "none"
        raise ConfigError(f"{what} has no complete checkpoint of step {step} in {folder.parent}; kept: {listed}")
    return str(folder)


# ---------------------------------------------------------------------------------------------
# In the worker


class ExportStopped(KestrelError):
    """Raised by the progress hook when a stop was asked; the export then removes its staging."""

    def __init__(self, request: str) -> None:
        super().__init__(f"export stopped ({request} requested)")
        self.request = request


class ProgressHook:
    """The engine's `progress(fraction, message)` for one job: writes it to the store and turns
    a stop request (or SIGTERM) into ExportStopped at the next call."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self.terminated = False  # set by the SIGTERM handler
        self._percent = -1
        self._written = self._polled = 0.0

    def __call__(self, fraction: float, message: str) -> None:
        self._check_stop()
        percent = max(0, min(TOTAL, int(fraction * TOTAL)))
        now = time.monotonic()
        # Every percent gets its row; within one percent (tensor after tensor) the stage text
        # is refreshed at most every WRITE_EVERY_S, so a big model does not flood the store.
        if percent != self._percent or now - self._written >= WRITE_EVERY_S:
            queries.write_metrics(self.job_id, [(percent, "progress", float(fraction))], stage=message)
            self._percent, self._written = percent, now

    def _check_stop(self) -> None:
        """Raise ExportStopped when SIGTERM came or the store holds a cancel or pause request."""
        if self.terminated:
            raise ExportStopped("pause")
        now = time.monotonic()
        if now - self._polled >= STOP_POLL_S:
            self._polled = now
            with session() as s:
                request = s.scalar(select(Job.stop_request).where(Job.id == self.job_id))
            if request:
                raise ExportStopped(request)


def run(job_id: int, config: dict[str, Any], device: str) -> tuple[str, str | None]:
    """Run one export job in its worker; returns (status, error). Raises KestrelError on bad
    input or a failed check (the worker turns it into `failed` with its message)."""
    from transformers.utils import logging as hf_logging

    from kestrel.export import export

    hf_logging.disable_progress_bar()  # the job's stage says what loads; bars only clutter the log
    hook = ProgressHook(job_id)
    signal.signal(signal.SIGTERM, lambda *_: setattr(hook, "terminated", True))
    queries.truncate_metrics(job_id, 0)  # a resumed export starts again from nothing
    with session(immediate=True) as s:
        s.execute(update(Job).where(Job.id == job_id).values(total_steps=TOTAL, stage=None))
    archive = bool(config.get("archive")) and config["format"] != "gguf"
    try:
        hook(0.0, "starting")
        # The worker sees one GPU (CUDA_VISIBLE_DEVICES) or none; None lets the engine pick it.
        result = export(config["source"], config["format"], config["output_dir"], quant=config["quant"],
                        progress=(lambda f, m: hook(f * ARCHIVED_AT, m)) if archive else hook,
                        check=config["check"], device="cpu" if device == "cpu" else None)
        print(result.summary(), flush=True)
        files = list(result.files)
        if archive:
            files += write_archive(Path(config["output_dir"]), files, hook)
            hook(1.0, "done")
    except ExportStopped as stop:
        status = CANCELLED if stop.request == "cancel" else INTERRUPTED
        note = "stopped by SIGTERM; resume runs the export again" if hook.terminated else None
        return status, note
    record_files(job_id, files, config["format"])
    return COMPLETED, None


def write_archive(out: Path, files: list[Path], hook: ProgressHook) -> list[Path]:
    """[`<out>/<out name>.zip`] of `files` (one download for the browser), or [] when they are
    over ARCHIVE_LIMIT. Weights are stored, not deflated: they barely compress and it is slow."""
    if sum(f.stat().st_size for f in files) > ARCHIVE_LIMIT:
        print(f"[jobs] not zipping: the files are over {ARCHIVE_LIMIT / 2**30:.0f} GiB; they are in {out}", flush=True)
        return []
    hook(ARCHIVED_AT, "zipping the files for download")
    target = out / f"{out.name}.zip"
    partial = target.with_name(target.name + ".part")  # a stopped zip never sits under the final name
    try:
        with zipfile.ZipFile(partial, "w") as archive:
            for f in files:
                archive.write(f, f.name, zipfile.ZIP_STORED if f.suffix == ".safetensors" else zipfile.ZIP_DEFLATED)
                hook(ARCHIVED_AT, f"zipped {f.name}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return [target]


def record_files(job_id: int, files: list[Path], fmt: str) -> None:
    """An artifact row (kind, path, size, sha256) for each file the export wrote."""
    fallback = {"adapter": "adapter", "merged": "model", "gguf": "gguf"}[fmt]
    for path in files:
        kind = {".gguf": "gguf", ".zip": "archive"}.get(path.suffix) or {
            "Modelfile": "modelfile", "export.json": "report"}.get(path.name, fallback)
        queries.record_artifact(job_id, kind, path)
