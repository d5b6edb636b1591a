"""Export tab handlers: a run's final weights or one of its checkpoints (or the demo model) to a
LoRA adapter, a merged 16-bit model or a GGUF file with its Ollama Modelfile.

Every export is a job (kind export, see kestrel/jobs/export_job.py) that a worker process runs, never
the studio: Export submits it through `jobs`, and all the tab shows comes from the store: the
job's progress and stage, its artifacts (the files to download: the GGUF and its Modelfile, or
one zip of the adapter or merged model) and the Modelfile's text. An export therefore goes on
when the page or the studio closes, and a new handler call (another page, a restarted studio)
finds it again. Files land in KESTREL_HOME/exports/job-<id>-<name>/.

    job_id = start_export("run:3", "gguf", "q4_k_m")   # or the same export already under way
    start_export("run:3", "gguf", "q4_k_m", "40")        # the checkpoint of step 40
    export_view(job_id)     # {"status", "file", "modelfile"} of one export job, its checks included
    for out in run_export("run:3", "final", "gguf", "q4_k_m"): ...   # Export's click: submit, then follow
    recent_exports()        # the recent export jobs with status and download links (markdown)
"""

from __future__ import annotations

import functools
import html
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import gradio as gr

from kestrel import jobs
from kestrel.errors import KestrelError
from kestrel.export import MERGED_DTYPES, QUANT_TYPES, describe_check
from kestrel.export.quantize import QUANTS, size_hint
from kestrel.studio import files
from kestrel.studio import strings as S
from kestrel.studio.handlers.common import DEMO, log, user_errors
from kestrel.training.checkpoints import human_size
from kestrel.studio.handlers.weights import (
    BEST, FINAL, best_of, follow_newest, run_of, usable_runs, weights_choice, weights_of,
)

EXPORT = "export"  # kestrel.jobs.models.EXPORT: the job kind
IN_FLIGHT = ("queued", "running")
POLL_S = 0.5  # how often Export's click reads the job while it runs
RECENT = 10  # export jobs listed under Recent exports


def source_choices(runs: list[jobs.Job] | None = None) -> list[tuple[str, str]]:
    """Runs with weights (newest first; a checkpoint counts), then the demo model."""
    runs = usable_runs() if runs is None else runs
    out = [(S.CH_RUN_CHOICE.format(job=j.id, name=j.name or ""), f"run:{j.id}") for j in runs]
    return out + [(S.CH_BASE_CHOICE.format(model=DEMO), f"base:{DEMO}")]


def refresh_sources(current: str | None, seen: int | None) -> dict[str, Any]:
    """Outputs: source (the list; the newest run when one appeared since `seen`), seen (the
    newest run's id now)."""
    runs = usable_runs()
    choices = source_choices(runs)
    value = follow_newest([v for _, v in choices], current, seen, runs)
    return {"source": gr.update(choices=choices, value=value), "seen": runs[0].id if runs else seen}


def show_sources(current: str | None, seen: int | None, checkpoint: str | None, fmt: str,
                 quant: str | None) -> dict[str, Any]:
    """`refresh_sources` and `pick_source` of its choice in one answer (the weights' list also
    gains checkpoints saved since): see `kestrel.studio.handlers.chat.show_targets` for why."""
    out = refresh_sources(current, seen)
    return {**out, **pick_source(out["source"]["value"], checkpoint, fmt, quant)}


def _folder(source: str | None, checkpoint: str | None) -> str:
    """What `kestrel.export` reads for the tab's choice: the demo, or the folder of the weights."""
    job = run_of(source)
    return DEMO if job is None else str(weights_of(job, checkpoint).folder)


@functools.lru_cache(maxsize=32)
def _size_basis(folder: str, _mtime: float) -> tuple[int, bool]:
    from kestrel.export.formats import size_basis

    return size_basis(folder)


def size_basis(source: str | None, checkpoint: str | None) -> tuple[int, bool] | None:
    """(weights an export of the choice writes, whether its rows fill k-quant blocks), read from
    file headers; None when unreadable: the export itself then says why."""
    try:
        folder = _folder(source, checkpoint)
        mtime = Path(folder).stat().st_mtime if folder != DEMO else 0.0
        return _size_basis(folder, mtime)
    except (KestrelError, OSError, ValueError) as exc:
        log.info("no parameter count for %s: %s", source, exc)
        return None


def quant_label(quant: str, basis: tuple[int, bool] | None) -> str:
    """`q4_k_m · about 4.9 GB · balanced size and quality; recommended` (`up to` where the rows
    are too narrow for the type's blocks)."""
    note = QUANTS[quant].quality
    if not basis:
        return S.EX_QUANT_NO_SIZE.format(quant=quant, note=note)
    nbytes, bound = size_hint(basis[0], quant, basis[1])
    size = (S.EX_SIZE_UP_TO if bound else S.EX_SIZE_ABOUT).format(size=human_size(nbytes))
    return S.EX_QUANT_HINT.format(quant=quant, size=size, note=note)


def quant_choices(fmt: str, basis: tuple[int, bool] | None = None, current: str | None = None) -> dict[str, Any]:
    """The quantization dropdown for a format (hidden for the adapter); GGUF types carry their
    size for the weights of `basis` (see `size_basis`) and their quality note."""
    if fmt == "gguf":
        value = current if current in QUANT_TYPES else "q4_k_m"
        info = None
        if basis:
            info = (S.EX_QUANT_INFO if basis[1] else S.EX_QUANT_INFO_BOUND).format(params=f"{basis[0]:,}")
        return {"quant": gr.update(choices=[(quant_label(q, basis), q) for q in QUANT_TYPES], value=value,
                                   visible=True, info=info)}
    if fmt == "merged":
        return {"quant": gr.update(choices=list(MERGED_DTYPES), value=current if current in MERGED_DTYPES else "auto",
                                   visible=True)}
    return {"quant": gr.update(visible=False, value=None)}


@user_errors
def pick_source(source: str | None, checkpoint: str | None, fmt: str, quant: str | None) -> dict[str, Any]:
    """Outputs: checkpoint (the run's weights: final or a checkpoint; hidden for the demo), quant
    (the list for the format, sized for the chosen weights)."""
    ckpt, checkpoint = weights_choice(run_of(source), checkpoint)
    basis = size_basis(source, checkpoint) if fmt == "gguf" else None
    return {"checkpoint": ckpt, **quant_choices(fmt, basis, quant)}


# ---------------------------------------------------------------------------------------------
# Starting an export and following it


def export_config(source: str, fmt: str, quant: str | None, checkpoint: str | None = None) -> dict[str, Any]:
    """The export job's config for a choice of the tab (`run:3` or `base:demo`, with the run's
    weights: `best`, `final` or a checkpoint's step); jobs.submit checks it (a run without those
    weights, an unknown quantization). A run folder exports its best weights when it has them
    (`kestrel.export`), so `final` of such a run names its adapter or model folder."""
    kind, _, rest = (source or "").partition(":")
    step: int | None = None
    if kind == "base" and rest == DEMO:
        src: str | int = DEMO
    elif kind == "run" and rest.isdigit():
        src = int(rest)
        job = jobs.get_job(src)
        if checkpoint == BEST and best_of(job) is None:
            raise KestrelError(S.ERR_BEST_GONE.format(job=src))
        if checkpoint == FINAL and best_of(job) is not None:
            final = weights_of(job, FINAL)
            src = str(final.adapter or final.model)
        elif checkpoint not in (None, "", FINAL, BEST):
            if not str(checkpoint).isdigit():
                raise KestrelError(S.ERR_CHECKPOINT_CHOICE.format(value=checkpoint))
            step = int(str(checkpoint))
    else:
        raise KestrelError(S.EX_NO_RUNS)
    # The adapter or merged model goes to the browser as one zip, which the worker writes.
    return {"kind": EXPORT, "source": src, "checkpoint": step, "format": fmt,
            "quant": quant if fmt in ("gguf", "merged") else None, "archive": fmt != "gguf"}


def _same_export(config: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two exports the same: source (a run's id or a path), its checkpoint, format,
    quantization."""
    return (config.get("source_job") or config["source"], config.get("checkpoint"), config["format"],
            (config["quant"] or "").lower())


def start_export(source: str, fmt: str, quant: str | None, checkpoint: str | None = None) -> int:
    """Submit an export job and return its id; the id of the same export when one is already
    queued or running (Export pressed twice, or again after a restart), so none runs twice."""
    config = export_config(source, fmt, quant, checkpoint)
    wanted = _same_export(config)
    for job in jobs.list_jobs(kind=EXPORT):
        if job.status in IN_FLIGHT and _same_export(job.config) == wanted:
            return job.id
    return jobs.submit(config)


def _bar(fraction: float, message: str) -> str:
    filled = int(max(0.0, min(1.0, fraction)) * 20)
    return f"`{'█' * filled}{'░' * (20 - filled)}` {fraction:.0%} · {html.escape(message)}"


def status_text(job: jobs.Job) -> str:
    """One line for an export job: a bar while it runs, else how it ended."""
    if job.status == "queued":
        return S.EX_QUEUED.format(job=job.id)
    if job.status == "running":
        return _bar(job.step / (job.total_steps or 100), job.stage or "starting")
    if job.status == "failed":
        return S.EX_FAILED.format(job=job.id, error=html.escape(job.error or ""))
    if job.status != "completed":
        return S.EX_STOPPED.format(job=job.id, status=job.status)
    return S.EX_DONE.format(seconds=(job.finished_at or 0) - (job.started_at or 0), out=job.output_dir)


def downloads(job: jobs.Job) -> tuple[list[str], str]:
    """(files to offer, a note) of a completed export, from its artifacts: the GGUF and its
    Modelfile, or the zip of the adapter / merged model (none when it was too large to zip)."""
    arts = jobs.list_artifacts(job.id)
    by_kind = {a.kind: a.path for a in arts if Path(a.path).is_file()}  # a file deleted since is not offered
    if job.config.get("format") == "gguf":
        return [by_kind[k] for k in ("gguf", "modelfile") if k in by_kind], ""
    if "archive" in by_kind:
        return [by_kind["archive"]], ""
    size = sum(a.size_bytes or 0 for a in arts if a.kind not in ("log", "report"))
    return [], S.EX_FOLDER_ONLY.format(size=size / 2**30, out=job.output_dir)


def _report(job: jobs.Job) -> dict[str, Any]:
    """The export's export.json (its result: checks and notes), {} when absent."""
    report = next((a.path for a in jobs.list_artifacts(job.id, "report")), None)
    if report is None or not Path(report).is_file():
        return {}
    return json.loads(Path(report).read_text())


def _notes(report: dict[str, Any]) -> str:
    """The export's notes, as markdown list lines."""
    return "".join(f"\n- {html.escape(str(n))}" for n in report.get("notes") or [])


def checks_text(report: dict[str, Any]) -> str:
    """Markdown: each check of the export (llama.cpp's agreement with the Hugging Face model, the
    tokenizer, the chat template...), worded as the command line prints them."""
    found = report.get("checks") or {}
    if not found:
        return ""
    lines = []
    for name, check in found.items():
        passed = check.get("passed") if isinstance(check, dict) else None
        details = html.escape(str(describe_check({k: v for k, v in check.items() if k != "passed"})
                                  if isinstance(check, dict) else check))
        if passed is None:  # facts of the export (the Modelfile's chat format...), no verdict
            lines.append(S.EX_CHECK_INFO.format(name=html.escape(name), details=details))
        else:
            verdict = "passed" if passed else "FAILED"
            lines.append(S.EX_CHECK_LINE.format(name=html.escape(name), verdict=verdict, details=details))
    return "\n\n" + S.EX_CHECKS + "\n" + "\n".join(lines)


def export_view(job_id: int) -> dict[str, Any]:
    """One export job as the tab shows it, read from the store. Outputs: status, file (paths to
    download, None until completed), modelfile (the Modelfile's text beside a GGUF, else "")."""
    job = jobs.get_job(job_id)
    if job.status != "completed":
        return {"status": status_text(job), "file": None, "modelfile": ""}
    offered, note = downloads(job)
    modelfile = next((Path(p) for p in offered if Path(p).name == "Modelfile"), None)
    report = _report(job)
    status = status_text(job) + (f"\n\n{note}" if note else "") + _notes(report) + checks_text(report)
    return {"status": status, "file": offered or None,
            "modelfile": modelfile.read_text() if modelfile and modelfile.is_file() else ""}


@user_errors
def run_export(source: str, checkpoint: str | None, fmt: str, quant: str | None) -> Iterator[dict[str, Any]]:
    """Export's click: submit the export (or find the same one under way) and relay its progress
    from the store until it ends. Outputs: status (with the checks once done), file, modelfile.
    Closing the page ends only this relay; the job goes on and is listed under Recent exports."""
    job_id = start_export(source, fmt, quant, checkpoint)
    shown: tuple[Any, ...] | None = None
    while (job := jobs.get_job(job_id)).status in IN_FLIGHT:
        state = (job.status, job.step, job.stage)
        if state != shown:
            update = {"file": None, "modelfile": ""} if shown is None else {"file": gr.skip(), "modelfile": gr.skip()}
            yield {"status": status_text(job), **update}
            shown = state
        time.sleep(POLL_S)
    yield export_view(job_id)


# ---------------------------------------------------------------------------------------------
# Recent exports


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return html.escape(text).replace("|", "&#124;").replace("\n", " ")


def _link(path: str) -> str:
    """A download link for a file the studio serves (under exports/), else the path as text."""
    p = Path(path)
    if files.exports_dir().resolve() not in p.resolve().parents:
        return f"`{_cell(path)}`"
    # Relative to the page, so the studio works under a path prefix too; Gradio serves files
    # below allowed_paths (files.served_dirs) at gradio_api/file=<absolute path>.
    return f'<a href="gradio_api/file={quote(str(p.resolve()))}" download="{_cell(p.name)}">{_cell(p.name)}</a>'


def _row(job: jobs.Job) -> str:
    """One export job as a table row: id, name, status (percent and stage while running), links."""
    if job.status == "running":
        state = f"{job.step / (job.total_steps or 100):.0%} · {job.stage or 'starting'}"
    elif job.status == "failed":
        state = f"failed: {(job.error or '').splitlines()[0][:120] if job.error else ''}"
    else:
        state = job.status
    offered, note = downloads(job) if job.status == "completed" else ([], "")
    got = " ".join(_link(p) for p in offered) or (S.EX_IN_FOLDER.format(out=_cell(job.output_dir)) if note else "")
    return f"| {job.id} | {_cell(job.name or '')} | {_cell(state)} | {got} |"


def recent_exports() -> str:
    """Markdown: the newest export jobs with their status (progress while running) and download
    links, read from the store; the tab re-reads it on a timer, so a restart loses nothing."""
    recent = jobs.list_jobs(kind=EXPORT, limit=RECENT)
    if not recent:
        return f"**{S.EX_RECENT}**\n\n{S.EX_RECENT_NONE}"
    head = "| " + " | ".join(S.EX_RECENT_COLUMNS) + " |\n|" + "---|" * len(S.EX_RECENT_COLUMNS)
    return f"**{S.EX_RECENT}**\n\n{head}\n" + "\n".join(_row(j) for j in recent)
