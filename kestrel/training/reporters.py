"""Where a run's metrics go besides the job store: the one sink every front end shares.

    sinks = metric_sinks(config, output_dir)   # metrics.jsonl, TensorBoard, + report_to
    cb = CallbackList([*sinks, *callbacks])    # the job store's DbCallback is one of `callbacks`

- `metrics.jsonl` (`JsonlWriter`): always.
- TensorBoard event files in `output_dir/tensorboard/`: always (`tensorboard --logdir RUN`).
  Tags follow the Hugging Face Trainer's (`train/loss`, `eval/loss`), so dashboards carry over.
- Weights & Biases when `report_to` lists wandb: offline (files under the run folder, synced
  later with `wandb sync`) unless the user set WANDB_MODE.
- MLflow when `report_to` lists mlflow: a file store in `output_dir/mlruns` unless the user set
  MLFLOW_TRACKING_URI. Both are checked to be installed when the config is validated.

A step's metrics (`on_step`) carry `step`; eval_* metrics arrive as their own call at the step
they were measured.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from kestrel.config import TrainConfig
from kestrel.training.metrics import METRICS_FILE, Callback, JsonlWriter, RunInfo

log = logging.getLogger("kestrel")
TENSORBOARD_DIR = "tensorboard"
NOT_LOGGED = ("step", "total_steps")


def tag(name: str) -> str:
    """The Hugging Face Trainer's tag of a metric: `eval_loss` -> `eval/loss`, `loss` -> `train/loss`."""
    return f"eval/{name[5:]}" if name.startswith("eval_") else f"train/{name}"


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a step, by tag (not `step` itself)."""
    return {tag(k): float(v) for k, v in metrics.items()
            if k not in NOT_LOGGED and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardWriter(Callback):
    """Event files in `folder`; a resumed run purges the events past its checkpoint."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.writer = Path(folder), None

    def on_start(self, info: RunInfo) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # requirements.txt pins it; a run never fails for want of a log format
            log.warning("TensorBoard event files are not written: the tensorboard package is not installed "
                        "(pip install tensorboard)")
            return
        purge = info.start_step + 1 if info.start_step > 0 else None
        self.writer = SummaryWriter(log_dir=str(self.folder), purge_step=purge, flush_secs=10)

    def on_step(self, metrics: dict[str, float]) -> None:
        if self.writer is None:
            return
        step = int(metrics["step"])
        for name, value in scalars(metrics).items():
            self.writer.add_scalar(name, value, step)

    def on_end(self, status: str, error: str | None = None) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbReporter(Callback):
    """A Weights & Biases run in `output_dir/wandb`, offline unless WANDB_MODE says otherwise."""

    def __init__(self, config: TrainConfig, output_dir: Path) -> None:
        self.config, self.output_dir, self.run = config, Path(output_dir), None

    def on_start(self, info: RunInfo) -> None:
        import wandb

        mode = None if os.environ.get("WANDB_MODE") else "offline"  # the user's choice wins
        self.run = wandb.init(project="kestrel", name=self.config.name or self.output_dir.name,
                              dir=str(self.output_dir), config=self.config.to_dict(), mode=mode,
                              resume="allow" if info.start_step else None, id=_run_id(self.output_dir))

    def on_step(self, metrics: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log(scalars(metrics), step=int(metrics["step"]))

    def on_end(self, status: str, error: str | None = None) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "completed" else 1)
            self.run = None


class MlflowReporter(Callback):
    """An MLflow run; a file store in `output_dir/mlruns` unless MLFLOW_TRACKING_URI is set."""

    def __init__(self, config: TrainConfig, output_dir: Path) -> None:
        self.config, self.output_dir, self.mlflow = config, Path(output_dir), None

    def on_start(self, info: RunInfo) -> None:
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((self.output_dir / "mlruns").resolve().as_uri())
        mlflow.start_run(run_name=self.config.name or self.output_dir.name)
        mlflow.log_params(_flat(self.config.to_dict()))
        self.mlflow = mlflow

    def on_step(self, metrics: dict[str, float]) -> None:
        if self.mlflow is not None:
            # MLflow keys allow `/`; the HF Trainer's MLflow callback logs the plain names.
            self.mlflow.log_metrics({k: float(v) for k, v in metrics.items() if k not in NOT_LOGGED
                                     and isinstance(v, (int, float))}, step=int(metrics["step"]))

    def on_end(self, status: str, error: str | None = None) -> None:
        if self.mlflow is not None:
            self.mlflow.end_run(status={"completed": "FINISHED", "failed": "FAILED"}.get(status, "KILLED"))
            self.mlflow = None


def _run_id(output_dir: Path) -> str:
    """A stable W&B run id per run folder, so a resumed run continues the same W&B run."""
    import hashlib

    return hashlib.sha1(str(output_dir.resolve()).encode()).hexdigest()[:16]


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:500]  # MLflow's parameter values are short text
    return out


def metric_sinks(config: TrainConfig, output_dir: Path) -> list[Callback]:
    """metrics.jsonl and TensorBoard always; W&B and MLflow when `config.report_to` lists them."""
    sinks: list[Callback] = [JsonlWriter(output_dir / METRICS_FILE), TensorBoardWriter(output_dir / TENSORBOARD_DIR)]
    if "wandb" in config.report_to:
        sinks.append(WandbReporter(config, output_dir))
    if "mlflow" in config.report_to:
        sinks.append(MlflowReporter(config, output_dir))
    return sinks
