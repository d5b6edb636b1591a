"""Which weights of a training run the Chat and Export tabs can use: its best weights (a run with
an evaluation set keeps those of its best evaluation in RUN/best, recorded in the job store as a
`best` artifact), its final adapter or model, or one of the checkpoints it saved (training keeps
the newest few, also while it runs and after it failed or was stopped).

A choice of weights is a string: `best`, `final`, or the step of a checkpoint (`"40"`). The first
listed is the default, and matches what `kestrel.export` picks for a run folder: the best weights
when the run has them.

    runs = usable_runs()                        # training jobs with weights, newest first
    checkpoint_choices(runs[0])                 # [("Best weights: eval_loss 0.41 at step 30", "best"),
                                                #  ("Final weights", "final"), ("Checkpoint at step 40", "40")]
    weights_of(runs[0], "40").adapter           # output_dir/checkpoints/step-000040/adapter
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from kestrel import jobs
from kestrel.errors import KestrelError
from kestrel.jobs.models import EXPORT
from kestrel.studio import strings as S
from kestrel.training.best import BEST_DIR, read_best
from kestrel.training.checkpoints import checkpoint_dir, complete_checkpoints

FINAL, BEST = "final", "best"


@dataclass(frozen=True)
class RunWeights:
    """Weights in one folder: a LoRA adapter (on the run's base model) or a full model."""

    folder: Path  # the run folder or a checkpoint folder, holding adapter/ or model/
    adapter: Path | None
    model: Path | None

    @property
    def step(self) -> int | None:
        """The checkpoint's step, None for the final weights."""
        return int(self.folder.name[5:]) if self.folder.parent.name == "checkpoints" else None

    @property
    def best(self) -> bool:
        """The run's best weights (RUN/best)."""
        return self.folder.name == BEST_DIR


def _weights_in(folder: Path) -> RunWeights | None:
    adapter, model = folder / "adapter", folder / "model"
    if (adapter / "adapter_config.json").is_file():
        return RunWeights(folder, adapter, None)
    if (model / "config.json").is_file():
        return RunWeights(folder, None, model)
    return None


def checkpoints(job: jobs.Job) -> list[int]:
    """Steps of the run's complete checkpoints that hold weights, newest first."""
    found = complete_checkpoints(Path(job.output_dir))
    return [step for step, folder in reversed(found) if _weights_in(folder) is not None]


def has_final(job: jobs.Job) -> bool:
    return _weights_in(Path(job.output_dir)) is not None


def best_of(job: jobs.Job) -> dict | None:
    """The run's best weights ({"step", "metric", "value", "path"}) when the store lists them and
    their marker says they are complete, else None."""
    if not job.output_dir or not jobs.list_artifacts(job.id, "best"):
        return None
    best = read_best(Path(job.output_dir))
    return best if best is not None and _weights_in(Path(job.output_dir) / BEST_DIR) is not None else None


def usable_runs() -> list[jobs.Job]:
    """Training jobs that left final weights or at least one checkpoint, newest first."""
    return [j for j in jobs.list_jobs() if j.kind != EXPORT and j.output_dir and (has_final(j) or checkpoints(j))]


def checkpoint_choices(job: jobs.Job) -> list[tuple[str, str]]:
    """(label, value) of the run's weights: the best ones (when listed), the final ones (when
    saved), then each checkpoint, newest first. The first is the default."""
    best = best_of(job)
    top = [(S.WEIGHTS_BEST.format(metric=best["metric"], value=best["value"], step=best["step"]), BEST)] if best else []
    final = [(S.WEIGHTS_FINAL, FINAL)] if has_final(job) else []
    return top + final + [(S.WEIGHTS_STEP.format(step=step), str(step)) for step in checkpoints(job)]


def run_of(choice: str | None) -> jobs.Job | None:
    """The run a Chat or Export choice names (`run:<id>`); None for a base model (`base:<name>`)."""
    kind, _, rest = (choice or "").partition(":")
    return jobs.get_job(int(rest)) if kind == "run" and rest.isdigit() else None


def weights_choice(job: jobs.Job | None, current: str | None) -> tuple[dict[str, Any], str | None]:
    """(the weights dropdown of a Chat or Export choice, the weights it names): the run's
    `checkpoint_choices`, keeping `current` while listed, else the first; hidden for a base model
    (`job` None)."""
    if job is None:
        return gr.update(visible=False, choices=[], value=None), None
    choices = checkpoint_choices(job)
    values = [v for _, v in choices]
    chosen = current if current in values else (values[0] if values else None)
    return gr.update(visible=True, choices=choices, value=chosen), chosen


def weights_of(job: jobs.Job, choice: str | None) -> RunWeights:
    """The weights `choice` names (None: the best ones, else the final ones, else the newest
    checkpoint: the first of `checkpoint_choices`)."""
    text = str(choice or "").strip()
    if text == BEST or (not text and best_of(job) is not None):
        if best_of(job) is None or (found := _weights_in(Path(job.output_dir) / BEST_DIR)) is None:
            raise KestrelError(S.ERR_BEST_GONE.format(job=job.id))
        return found
    if text in ("", FINAL):
        if (found := _weights_in(Path(job.output_dir))) is not None:
            return found
        if not text and (steps := checkpoints(job)):
            return weights_of(job, str(steps[0]))
        raise KestrelError(S.ERR_RUN_NO_WEIGHTS.format(job=job.id, status=job.status))
    if not text.isdigit():
        raise KestrelError(S.ERR_CHECKPOINT_CHOICE.format(value=text))
    folder = checkpoint_dir(Path(job.output_dir), int(text))
    found = _weights_in(folder) if (folder / "state.json").is_file() else None
    if found is None:
        kept = ", ".join(str(s) for s in checkpoints(job)) or "none"
        raise KestrelError(S.ERR_CHECKPOINT_GONE.format(job=job.id, step=int(text), kept=kept))
    return found


def follow_newest(values: list[str], current: str | None, seen: int | None, runs: list[jobs.Job]) -> str | None:
    """The choice a list of runs and models shows after a refresh: the newest run when it is newer
    than the newest one the page had seen (a run finished, or saved its first checkpoint, since
    the page loaded), else the current choice while it is still listed, else the first entry."""
    newest = runs[0].id if runs else None
    if newest is not None and (seen is None or newest > seen):
        return f"run:{newest}"
    return current if current in values else (values[0] if values else None)


def model_folders() -> list[tuple[str, str]]:
    """(label, folder) of the full models that runs saved as their final weights, newest first:
    the local models the Train form offers to train further (DPO or GRPO on top of a fine-tune).
    A LoRA run's adapter is not a model: it continues through `lora.init_from`."""
    found = ((job, _weights_in(Path(job.output_dir))) for job in usable_runs())
    return [(S.TR_MODEL_RUN.format(job=job.id, name=job.name), str(w.model)) for job, w in found
            if w is not None and w.model is not None]


def model_box(source: str) -> dict[str, Any]:
    """The Train form's model box for a model source: hidden for the built-in demo; for a local
    folder, the runs' full models offered (a typed path is kept); for a hub id, free text."""
    choices = model_folders() if source == "local" else []
    return gr.update(visible=source != "demo", choices=choices,
                     info=S.TR_MODEL_LOCAL_INFO if source == "local" else S.TR_MODEL_INFO)
