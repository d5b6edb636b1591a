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
import numpy as np
import pandas as pd

from kestrel import jobs
from kestrel.errors import KestrelError
from kestrel.jobs.models import FINISHED, RESUMABLE
from kestrel.studio import strings as S
from kestrel.studio.handlers.common import fmt_duration, user_errors
from kestrel.studio.handlers.generation import OUTPUTS as GENERATION_OUTPUTS, generation_view
from kestrel.studio.handlers.weights import best_of

CHART_POINTS = 500
LOG_LINES = 60
BAR_CELLS = 12
# chart key -> metric names drawn on it (a name ending in "*" is a prefix)
CHART_SERIES: dict[str, tuple[str, ...]] = {
    "loss": ("loss", "eval_loss"), "lr": ("lr",), "grad_norm": ("grad_norm",), "tokens_per_s": ("tokens_per_s",),
    # a run on several GPUs adds each GPU's peak (vram_peak_gib/gpuN)
    "memory": ("vram_alloc_gib", "vram_peak_gib", "vram_peak_gib/gpu*"),
    # training's and evaluation's: GRPO's reward, reward/<name>; a preference method's rewards/*
    "reward": ("reward*", "eval_reward*"), "kl": ("kl", "eval_kl"),
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
    """Seconds left, from the pace of the current attempt: a resumed run counts only the steps
    it made since it started again (its earlier steps took time before `started_at`)."""
    if job.status != "running" or not job.total_steps or not job.step or not job.started_at:
        return None
    start = jobs.attempt_start_step(job.id, job.started_at)
    if job.step <= start:
        return None
    return (now - job.started_at) / (job.step - start) * (job.total_steps - job.step)


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


def _series_frame(points: list[Any]) -> pd.DataFrame:
    """(step, value, name) rows with numeric step and value columns even when empty: gr.LinePlot
    takes a column's plot type from its dtype, and an empty frame's default (object) would make
    the axes categorical."""
    return pd.DataFrame({"step": pd.Series([p.step for p in points], dtype="int64"),
                         "value": pd.Series([p.value for p in points], dtype="float64"),
                         "name": pd.Series([p.name for p in points], dtype="object")})


def _without_twins(frame: pd.DataFrame, total: str = "reward") -> pd.DataFrame:
    """Drop each `reward/<name>` series equal to the total at every step (one reward of weight 1):
    drawn over the total, it would hide it."""
    whole = frame[frame["name"] == total].set_index("step")["value"]
    drop = []
    for name, part in frame[frame["name"].str.startswith(total + "/")].groupby("name"):
        series = part.set_index("step")["value"]
        if len(series) == len(whole) and series.index.equals(whole.index) and np.allclose(series, whole):
            drop.append(name)
    return frame[~frame["name"].isin(drop)].reset_index(drop=True)


def chart_frames(job: jobs.Job | None) -> dict[str, pd.DataFrame]:
    """One long-format DataFrame (step, value, name) per chart, from the store's downsampled series."""
    points = jobs.metric_series(job.id, None, CHART_POINTS) if job is not None else []
    frame = _series_frame([p for p in points if not math.isnan(p.value)])
    out = {f"chart_{key}": frame[frame["name"].map(lambda n, pats=pats: _matches(n, pats)).astype(bool)]
           .reset_index(drop=True) for key, pats in CHART_SERIES.items()}
    out["chart_reward"] = _without_twins(_without_twins(out["chart_reward"]), "eval_reward")
    memory = out["chart_memory"]
    if len(memory) and not memory["value"].any():  # a CPU run reports 0 GiB: nothing to draw
        out["chart_memory"] = memory.iloc[0:0]
    return out


def _rebuild_pending(seen: dict[str, Any]) -> bool:
    """Whether a chart of this browser still waits to be rebuilt for series it was sent."""
    return any(names != seen.get("built", {}).get(key) for key, names in seen.get("series", {}).items())


def chart_updates(job: jobs.Job | None, seen: dict[str, Any]) -> dict[str, Any]:
    """The charts' new values. The page's chart fixes its colour domain (the series names) when it
    is built and keeps it through later values, so series it was built without stay invisible. A
    chart is rebuilt by a change of its `colors_in_legend`; the page applies that before the new
    value of the same update, so it is sent on the poll after the one that brought new series
    (`seen["series"]`: names sent; `seen["built"]`: names a chart was rebuilt for). The memory
    chart of a run on the CPU says in its title why it is empty."""
    sent = seen["series"] = dict(seen.get("series") or {})
    built = seen["built"] = dict(seen.get("built") or {})
    on_cpu = job is not None and (job.device or job.requested_device) == "cpu"
    out: dict[str, Any] = {}
    for key, frame in chart_frames(job).items():
        change: dict[str, Any] = {}
        names = sorted(frame["name"].unique())
        if names == sent.get(key) and names != built.get(key):
            built[key] = change["colors_in_legend"] = names
        sent[key] = names
        if key == "chart_memory":  # in the title: a caption falls below the chart's fixed height
            change["title"] = S.RU_MEMORY_CPU if on_cpu and frame.empty else S.CHARTS["memory"]
        out[key] = gr.update(value=frame, **change) if change else frame
    return out


def progress_text(job: jobs.Job | None) -> str:
    if job is None:
        return S.RU_NO_JOBS
    eta = _eta(job, time.time())
    error = f"\n\n⚠️ {html.escape(job.error)}" if job.error else ""
    eta_text = f" · {S.RU_ETA.format(eta=fmt_duration(eta))}" if eta else ""
    best = best_of(job) if job.kind != "export" else None  # recorded in the store when written
    best_text = S.RU_BEST.format(metric=best["metric"], value=best["value"], step=best["step"]) if best else ""
    return S.RU_PROGRESS.format(job=job.id, name=html.escape(job.name or ""), status=job.status, step=job.step,
                                total=job.total_steps or "?", eta=eta_text + best_text, error=error)


def _find(job_list: list[jobs.Job], job_id: Any) -> jobs.Job | None:
    try:
        wanted = int(job_id)
    except (TypeError, ValueError):
        return None
    return next((j for j in job_list if j.id == wanted), None)


# action -> the job statuses in which it can act (kestrel.jobs.runner: pause and cancel stop a
# queued or running job, resume takes a finished one that did not complete, delete any not running)
ACTIONS = ("pause", "resume", "cancel", "delete")
VALID_IN: dict[str, tuple[str, ...]] = {
    "pause": ("queued", "running"), "cancel": ("queued", "running"), "resume": RESUMABLE,
    "delete": ("queued", *FINISHED),
}


def action_buttons(job: jobs.Job | None) -> dict[str, Any]:
    """Each action's button enabled only where the selected job's status allows it."""
    return {action: gr.update(interactive=job is not None and job.status in VALID_IN[action]) for action in ACTIONS}


def _notice(job: jobs.Job | None, job_list: list[jobs.Job], noticed: Any) -> tuple[Any, Any]:
    """(notice, noticed): the action notice cleared ("", None) once the job it is about has moved
    on from its status before the action to a finished one, or another job is shown; else both
    left as they are (gr.skip()). A deleted job's notice stays."""
    if not noticed:
        return gr.skip(), gr.skip()
    job_id, before = noticed
    target = _find(job_list, job_id)
    if target is None:
        return gr.skip(), gr.skip()
    moved_on = target.status != before and target.status in FINISHED
    if moved_on or job is None or job.id != job_id:
        return "", None
    return gr.skip(), gr.skip()


@user_errors
def refresh(selected: Any, seen: dict[str, Any] | None, noticed: Any = None, force: bool = False) -> dict[str, Any]:
    """Poll the store. Outputs: table, select, progress, chart_<key> (one per chart; eval_loss
    beside loss), grpo (visibility of the GRPO charts), generation_summary / generation_table (the
    end-of-run generation check), the action buttons (pause, resume, cancel, delete), notice, log,
    seen, noticed. Unchanged parts come back as gr.skip().

    `selected` is the chosen job id (None: the newest running job, else the newest job).
    `seen` is this browser's record of what it drew: {"jobs": signature, "job", "step", "log"}.
    `noticed` is (job id, its status before the action) while an action's notice is shown: a state
    of its own, as a poll running beside the action's click would write back the `seen` it read.
    """
    seen = dict(seen or {})
    job_list = jobs.list_jobs()
    job = _find(job_list, selected) or _find(job_list, _default_job(job_list))
    signature = [(j.id, j.status, j.step, j.total_steps) for j in job_list]
    out: dict[str, Any] = {key: gr.skip() for key in ("table", "select", "progress", "grpo", "log", *GENERATION_OUTPUTS,
                                                      *ACTIONS)}
    out.update({f"chart_{key}": gr.skip() for key in CHART_SERIES})
    if force or signature != seen.get("jobs"):
        out["table"] = jobs_frame(job_list)
        out["select"] = gr.update(choices=[(_label(j), j.id) for j in job_list],
                                  value=job.id if job else None)
    job_state = (job.id, job.status, job.step) if job else None
    if force or "job" not in seen or job_state != seen["job"] or _rebuild_pending(seen):
        out["progress"] = progress_text(job)
        out.update(chart_updates(job, seen))
        out.update(action_buttons(job))
        out["grpo"] = gr.update(visible=bool(job and job.kind in REWARD_KINDS))
        out.update(generation_view(job))
    out["notice"], out["noticed"] = _notice(job, job_list, noticed)
    log = jobs.log_tail(job.id, LOG_LINES) if job else ""
    if force or log != seen.get("log"):
        out["log"] = log
    seen.update(jobs=signature, job=job_state, log=log)
    out["seen"] = seen
    return out


def select_job(selected: Any, seen: dict[str, Any] | None, noticed: Any = None) -> dict[str, Any]:
    """A run picked by hand: redraw everything for it."""
    return refresh(selected, seen, noticed, force=True)


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


def act_and_note(action: str, selected: Any, remove_files: bool) -> dict[str, Any]:
    """`act`, remembering which job the notice is about and its status before the action (a pause
    may have ended the run by the time `act` returns); refresh clears the notice when that job
    has finished since or another is shown. Outputs: notice, noticed."""
    try:
        before = jobs.get_job(int(selected)).status
    except (KestrelError, TypeError, ValueError):  # none picked, or gone: `act` says so
        before = None
    text = act(action, selected, remove_files)
    return {"notice": text, "noticed": (int(selected), before)}


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
        frame = _series_frame(jobs.metric_series(job.id, ["loss", "eval_loss"], CHART_POINTS))
        label = f"#{job.id} {job.name or ''}"
        frames.append(frame.assign(run=[label + (" eval" if n == "eval_loss" else "") for n in frame["name"]])
                      .drop(columns="name"))
    flats = [_flat(job.config) for job in runs]
    keys = sorted(set().union(*flats) - {"output_dir"})
    diff = [[k, *[str(f.get(k, "-")) for f in flats]] for k in keys if len({str(f.get(k)) for f in flats}) > 1]
    columns = ["setting", *[f"#{j.id}" for j in runs]]
    if not diff:
        diff = [[S.RU_SAME_CONFIG, *[""] * len(runs)]]
    return {"compare_loss": pd.concat(frames, ignore_index=True), "compare_diff": pd.DataFrame(diff, columns=columns)}


def compare_choices() -> dict[str, Any]:
    return {"compare_select": gr.update(choices=[(_label(j), j.id) for j in jobs.list_jobs()])}
