"""Runs tab handlers: the job table, live charts, log tail, stop / resume / cancel / delete,
comparison. Everything is read from the job store on each poll; the tab's `gr.State` holds only
what this browser last drew (to skip redrawing what has not changed).

    out = refresh(selected=None, seen={})    # picks the newest running job
    out["chart_loss"]                        # DataFrame(step, value, name) for gr.LinePlot
    act("cancel", job_id)                    # "Job #3: stopping."
"""

from __future__ import annotations

import html
import math
import time
from typing import Any

import gradio as gr
import pandas as pd

from kestrel import jobs
from kestrel.errors import KestrelError
from kestrel.studio import strings as S
from kestrel.studio.handlers.common import fmt_duration, user_errors
from kestrel.studio.handlers.generation import OUTPUTS as GENERATION_OUTPUTS, generation_view

CHART_POINTS = 500
LOG_LINES = 60
BAR_CELLS = 12
# chart key -> metric names drawn on it (a name ending in "*" is a prefix)
CHART_SERIES: dict[str, tuple[str, ...]] = {
    "loss": ("loss", "eval_loss"), "lr": ("lr",), "grad_norm": ("grad_norm",), "tokens_per_s": ("tokens_per_s",),
    "memory": ("vram_alloc_gib", "vram_peak_gib"), "reward": ("reward*",), "kl": ("kl",),
}
GRPO_CHARTS = ("reward", "kl")
REWARD_KINDS = ("grpo", "preference")  # jobs whose metrics the reward and KL charts draw


def _label(job: jobs.Job) -> str:
    return f"#{job.id} {job.name or ''} ({job.status})"


def _bar(fraction: float | None) -> str:
    if fraction is None:
        return "-"
    filled = int(round(max(0.0, min(1.0, fraction)) * BAR_CELLS))
    return "█" * filled + "░" * (BAR_CELLS - filled) + f" {fraction:.0%}"


def _eta(job: jobs.Job, now: float) -> float | None:
    """Seconds left, from the pace since the job started (no per-job metric query)."""
    if job.status != "running" or not job.total_steps or not job.step or not job.started_at:
        return None
    return (now - job.started_at) / job.step * (job.total_steps - job.step)


def jobs_frame(job_list: list[jobs.Job]) -> pd.DataFrame:
    now = time.time()
    rows = []
    for j in job_list:
        progress = j.step / j.total_steps if j.total_steps else None
        started = time.strftime("%m-%d %H:%M", time.localtime(j.started_at)) if j.started_at else "-"
        rows.append([j.id, j.name or "", j.status, _bar(progress), fmt_duration(_eta(j, now)), started])
    return pd.DataFrame(rows, columns=S.RU_COLUMNS)


def _default_job(job_list: list[jobs.Job]) -> int | None:
    pick = [j for j in job_list if j.status == "running"] or job_list
    return pick[0].id if pick else None


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)


def chart_frames(job_id: int | None) -> dict[str, pd.DataFrame]:
    """One long-format DataFrame (step, value, name) per chart, from the store's downsampled series."""
    points = jobs.metric_series(job_id, None, CHART_POINTS) if job_id is not None else []
    frame = pd.DataFrame([(p.step, p.value, p.name) for p in points], columns=["step", "value", "name"])
    frame = frame[frame["value"].map(lambda v: not math.isnan(v))] if len(frame) else frame
    out = {f"chart_{key}": frame[frame["name"].map(lambda n, pats=pats: _matches(n, pats))].reset_index(drop=True)
           for key, pats in CHART_SERIES.items()}
    memory = out["chart_memory"]
    if len(memory) and not memory["value"].any():  # a CPU run reports 0 GiB: nothing to draw
        out["chart_memory"] = memory.iloc[0:0]
    return out


def progress_text(job: jobs.Job | None) -> str:
    if job is None:
        return S.RU_NO_JOBS
    eta = _eta(job, time.time())
    error = f"\n\n⚠️ {html.escape(job.error)}" if job.error else ""
    eta_text = f" · {S.RU_ETA.format(eta=fmt_duration(eta))}" if eta else ""
    return S.RU_PROGRESS.format(job=job.id, name=html.escape(job.name or ""), status=job.status, step=job.step,
                                total=job.total_steps or "?", eta=eta_text, error=error)


def _find(job_list: list[jobs.Job], job_id: Any) -> jobs.Job | None:
    try:
        wanted = int(job_id)
    except (TypeError, ValueError):
        return None
    return next((j for j in job_list if j.id == wanted), None)


@user_errors
def refresh(selected: Any, seen: dict[str, Any] | None, force: bool = False) -> dict[str, Any]:
    """Poll the store. Outputs: table, select, progress, chart_<key> (one per chart; eval_loss
    beside loss), grpo (visibility of the GRPO charts), generation_summary / generation_table (the
    end-of-run generation check), log, seen. Unchanged parts come back as gr.skip().

    `selected` is the chosen job id (None: the newest running job, else the newest job).
    `seen` is this browser's record of what it drew: {"jobs": signature, "job", "step", "log"}.
    """
    seen = dict(seen or {})
    job_list = jobs.list_jobs()
    job = _find(job_list, selected) or _find(job_list, _default_job(job_list))
    signature = [(j.id, j.status, j.step, j.total_steps) for j in job_list]
    out: dict[str, Any] = {key: gr.skip() for key in ("table", "select", "progress", "grpo", "log", *GENERATION_OUTPUTS)}
    out.update({f"chart_{key}": gr.skip() for key in CHART_SERIES})
    if force or signature != seen.get("jobs"):
        out["table"] = jobs_frame(job_list)
        out["select"] = gr.update(choices=[(_label(j), j.id) for j in job_list],
                                  value=job.id if job else None)
    job_state = (job.id, job.status, job.step) if job else None
    if force or "job" not in seen or job_state != seen["job"]:
        out["progress"] = progress_text(job)
        out.update(chart_frames(job.id if job else None))
        out["grpo"] = gr.update(visible=bool(job and job.kind in REWARD_KINDS))
        out.update(generation_view(job))
    log = jobs.log_tail(job.id, LOG_LINES) if job else ""
    if force or log != seen.get("log"):
        out["log"] = log
    seen.update(jobs=signature, job=job_state, log=log)
    out["seen"] = seen
    return out


def select_job(selected: Any, seen: dict[str, Any] | None) -> dict[str, Any]:
    """A run picked by hand: redraw everything for it."""
    return refresh(selected, seen, force=True)


def select_row(table: pd.DataFrame, evt: gr.SelectData) -> Any:
    """The job id of the table row the user clicked (the select dropdown's new value)."""
    row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
    return int(table.iloc[row, 0])


@user_errors
def act(action: str, selected: Any, remove_files: bool = False) -> str:
    """Pause, resume, cancel or delete the selected job; returns the notice to show."""
    if selected is None or selected == "":
        raise KestrelError(S.RU_PICK)
    job_id = int(selected)
    if action == "pause":
        jobs.pause(job_id)
    elif action == "cancel":
        result = jobs.cancel(job_id)
        return S.RU_ACTION_DONE["cancel"].format(job=job_id, result="stopping" if result == "stopping" else result)
    elif action == "resume":
        jobs.resume(job_id)
    elif action == "delete":
        jobs.delete(job_id, remove_files=bool(remove_files))
    else:
        raise KestrelError(S.ERR_UNKNOWN_ACTION.format(action=action))
    return S.RU_ACTION_DONE[action].format(job=job_id)


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@user_errors
def compare(selected: list[Any] | None) -> dict[str, Any]:
    """Outputs: compare_loss (train and eval loss of each run, coloured by run), compare_diff
    (differing settings)."""
    ids = [int(s) for s in (selected or [])]
    if len(ids) < 2:
        raise KestrelError(S.RU_PICK_TWO)
    runs = [jobs.get_job(i) for i in ids]
    frames = []
    for job in runs:
        pts = jobs.metric_series(job.id, ["loss", "eval_loss"], CHART_POINTS)
        label = f"#{job.id} {job.name or ''}"
        frames.append(pd.DataFrame({"step": [p.step for p in pts], "value": [p.value for p in pts],
                                    "run": [label + (" eval" if p.name == "eval_loss" else "") for p in pts]}))
    flats = [_flat(job.config) for job in runs]
    keys = sorted(set().union(*flats) - {"output_dir"})
    diff = [[k, *[str(f.get(k, "-")) for f in flats]] for k in keys if len({str(f.get(k)) for f in flats}) > 1]
    columns = ["setting", *[f"#{j.id}" for j in runs]]
    if not diff:
        diff = [[S.RU_SAME_CONFIG, *[""] * len(runs)]]
    return {"compare_loss": pd.concat(frames, ignore_index=True), "compare_diff": pd.DataFrame(diff, columns=columns)}


def compare_choices() -> dict[str, Any]:
    return {"compare_select": gr.update(choices=[(_label(j), j.id) for j in jobs.list_jobs()])}
