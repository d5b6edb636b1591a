"""The Runs tab's generation check: the held-out prompts a run answered, beside their reference
answers, with exact match and ROUGE-L (`kestrel.training.generation_check` wrote them), and the
"Check generations" button that answers them again on demand with the run's saved weights.
Answers the end-of-run check's time budget cut are marked beside the answer, with a note above
the table (files written before the budget have neither).

    generation_view(job)  -> {"generation_summary": markdown, "generation_table": DataFrame,
                              "check_generations": the button (enabled for a finished run with
                              weights and held-out prompts)}
    for out in check_generations(job_id): ...   # progress, then generation_view's outputs

The on-demand check runs `python -m kestrel.training.check_run` in a process of its own (its
output in RUN/generation_check.log): native code that crashes there (a CUDA kernel, the decode
path) ends that process, and the studio reports it instead of going down with it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from kestrel import jobs
from kestrel.errors import KestrelError
from kestrel.studio import strings as S
from kestrel.studio.handlers.common import user_errors
from kestrel.studio.handlers.weights import BEST, FINAL, best_of, checkpoint_choices, weights_of
from kestrel.training.generation_check import GENERATION_FILE

OUTPUTS = ("generation_summary", "generation_table", "check_generations")
CHECK_LOG = "generation_check.log"
POLL_S = 0.5
TIMEOUT_S = 30 * 60  # a check answers 8 prompts: far less, unless something hangs
IN_FLIGHT = ("queued", "running")


def _read(job: jobs.Job | None) -> dict[str, Any] | None:
    if job is None or not job.output_dir:
        return None
    try:
        data = json.loads((Path(job.output_dir) / GENERATION_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("rows"), list) else None


def _evaluates(job: jobs.Job) -> bool:
    cfg = job.config or {}
    return bool(cfg.get("eval_dataset")) or float(cfg.get("eval_split") or 0) > 0


def can_check(job: jobs.Job | None) -> bool:
    """A finished training run with held-out prompts and saved weights."""
    return (job is not None and job.kind != "export" and job.status not in IN_FLIGHT and bool(job.output_dir)
            and _evaluates(job) and bool(checkpoint_choices(job)))


def generation_view(job: jobs.Job | None) -> dict[str, Any]:
    """The summary line, one table row per prompt (prompt, reference, answer, scores), the button."""
    button = gr.update(interactive=can_check(job))
    data = _read(job)
    if data is None:
        return {"generation_summary": S.RU_GEN_NONE, "generation_table": pd.DataFrame(columns=S.RU_GEN_COLUMNS),
                "check_generations": button}
    rows = [[r.get("prompt", ""), r.get("reference", ""), _answer(r),
             "yes" if r.get("exact_match") else "no", round(float(r.get("rouge_l", 0.0)), 3)] for r in data["rows"]]
    summary = S.RU_GEN_SUMMARY.format(n=len(rows), step=data.get("step", "?"),
                                      exact=float(data.get("exact_match", 0.0)), rouge=float(data.get("rouge_l", 0.0)))
    if data.get("stopped_early"):  # files written before the time budget have no such key
        summary += "\n\n" + S.RU_GEN_CUT_NOTE.format(n=data["stopped_early"], seconds=float(data.get("seconds") or 0.0))
    return {"generation_summary": summary, "generation_table": pd.DataFrame(rows, columns=S.RU_GEN_COLUMNS),
            "check_generations": button}


def _answer(row: dict[str, Any]) -> str:
    """A row's answer, marked when the end-of-run check's time budget cut it."""
    answer = row.get("answer", "")
    return f"{answer} {S.RU_GEN_CUT}" if row.get("finished") == "time" else answer


def check_command(run_dir: str, weights: Path, step: int) -> list[str]:
    """The command that answers the run's held-out prompts with `weights` (a separate process)."""
    return [sys.executable, "-m", "kestrel.training.check_run", run_dir, "--weights", str(weights), "--step", str(step)]


def _choice(job: jobs.Job) -> tuple[str, Path, int]:
    """(label, folder, step) of the weights the check uses: the default of the run's list (the
    best weights when kept, else the final ones, else the newest checkpoint)."""
    label, value = checkpoint_choices(job)[0]
    found = weights_of(job, value)
    best = best_of(job) if value == BEST else None
    step = int(best["step"]) if best else found.step if value != FINAL else int(job.step or 0)
    return label.lower(), found.folder, int(step or 0)


def _failure(job: jobs.Job, code: int, log: Path) -> str:
    why = (S.RU_GEN_CRASHED.format(signal=signal.Signals(-code).name) if code < 0 and -code in signal.valid_signals()
           else S.RU_GEN_EXIT.format(code=code))
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        lines = []
    return S.RU_GEN_FAILED.format(job=job.id, why=why, detail=lines[-1] if lines else "no output")


@user_errors
def check_generations(selected: Any) -> Iterator[dict[str, Any]]:
    """Answer the selected run's held-out prompts again (see the module docstring). Outputs:
    generation_summary (progress, then the result), generation_table, check_generations."""
    if selected in (None, ""):
        raise KestrelError(S.RU_PICK)
    job = jobs.get_job(int(selected))
    if job.status in IN_FLIGHT:
        raise KestrelError(S.RU_GEN_NOT_FINISHED.format(job=job.id, status=job.status))
    if not _evaluates(job):
        raise KestrelError(S.RU_GEN_NO_EVAL.format(job=job.id))
    label, folder, step = _choice(job)
    log = Path(job.output_dir) / CHECK_LOG
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(check_command(job.output_dir, folder, step), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        while proc.poll() is None:
            seconds = time.monotonic() - started
            if seconds > TIMEOUT_S:
                raise KestrelError(S.RU_GEN_TIMEOUT.format(job=job.id, minutes=TIMEOUT_S // 60))
            yield {"generation_summary": S.RU_GEN_RUNNING.format(job=job.id, weights=label, seconds=seconds),
                   "check_generations": gr.update(interactive=False)}
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:  # timed out, or the page went away: the check ends with the request
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        yield {"check_generations": gr.update(interactive=True)}
        raise KestrelError(_failure(job, proc.returncode, log))
    yield generation_view(job)
