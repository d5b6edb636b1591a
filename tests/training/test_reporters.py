"""The metrics sink: TensorBoard tags, and W&B / MLflow reached only when report_to asks, offline
by default (fake modules stand in for both: neither is installed here)."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import pytest

from kestrel.config import config_from_dict
from kestrel.training.metrics import JsonlWriter, RunInfo
from kestrel.training.reporters import MlflowReporter, TensorBoardWriter, WandbReporter, metric_sinks, scalars


def _fake(name: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.calls = []
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _info(tmp_path: Path, start: int = 0) -> RunInfo:
    return RunInfo(str(tmp_path), 10, start, "cpu", "lora")


def test_tags_follow_the_hf_trainer() -> None:
    got = scalars({"step": 3, "total_steps": 9, "loss": 1.5, "eval_loss": 2.0, "eval_rewards/chosen": 0.5})
    assert got == {"train/loss": 1.5, "eval/loss": 2.0, "eval/rewards/chosen": 0.5}


def test_default_sinks_are_jsonl_and_tensorboard(tmp_path: Path) -> None:
    sinks = metric_sinks(config_from_dict({}), tmp_path)
    assert [type(s) for s in sinks] == [JsonlWriter, TensorBoardWriter]


def test_wandb_runs_offline_unless_the_user_chose_a_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = _fake("wandb", monkeypatch)

    class Run:
        def log(self, data, step):
            wandb.calls.append(("log", data, step))

        def finish(self, exit_code):
            wandb.calls.append(("finish", exit_code))

    wandb.init = lambda **kw: wandb.calls.append(("init", kw)) or Run()
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = config_from_dict(dict(report_to=["tensorboard", "wandb"], name="r1"))
    sinks = metric_sinks(cfg, tmp_path)
    reporter = next(s for s in sinks if isinstance(s, WandbReporter))
    reporter.on_start(_info(tmp_path))
    reporter.on_step({"step": 2, "loss": 1.0, "eval_loss": 1.2})
    reporter.on_end("completed")
    init = wandb.calls[0][1]
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path) and init["name"] == "r1"
    assert wandb.calls[1:] == [("log", {"train/loss": 1.0, "eval/loss": 1.2}, 2), ("finish", 0)]
    monkeypatch.setenv("WANDB_MODE", "online")
    WandbReporter(cfg, tmp_path).on_start(_info(tmp_path))
    assert wandb.calls[-1][1]["mode"] is None  # wandb reads WANDB_MODE itself


def test_mlflow_logs_to_a_file_store_in_the_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = _fake("mlflow", monkeypatch)
    for name in ("set_tracking_uri", "start_run", "log_params", "log_metrics", "end_run"):
        setattr(mlflow, name, lambda *a, _n=name, **kw: mlflow.calls.append((_n, a, kw)))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = config_from_dict(dict(report_to=["mlflow"]))
    reporter = next(s for s in metric_sinks(cfg, tmp_path) if isinstance(s, MlflowReporter))
    reporter.on_start(_info(tmp_path))
    reporter.on_step({"step": 5, "total_steps": 10, "eval_loss": 0.7})
    reporter.on_end("failed", "boom")
    names = [c[0] for c in mlflow.calls]
    assert names == ["set_tracking_uri", "start_run", "log_params", "log_metrics", "end_run"]
    assert mlflow.calls[0][1][0] == (tmp_path / "mlruns").resolve().as_uri()
    assert mlflow.calls[2][1][0]["lora.r"] == "16"
    assert mlflow.calls[3][1:] == (({"eval_loss": 0.7},), {"step": 5})
    assert mlflow.calls[4][2] == {"status": "FAILED"}


def test_tensorboard_resume_purges_events_past_the_checkpoint(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardWriter(tmp_path)
    first.on_start(_info(tmp_path))
    for step in range(1, 7):
        first.on_step({"step": step, "loss": float(step)})
    first.on_end("interrupted")
    # Event files are read in name order: `events.out.tfevents.<seconds>.<host>.<pid>.<n>`. Both writers here start
    # in one second of one process, so the names differ only in a process-wide counter, which sorts as text (10 < 9)
    # and so depends on the tests before. A real resume starts later; date the first file a minute back, as one would be.
    (old,) = tmp_path.glob("events.out.tfevents.*")
    stamp = old.name.split(".")[3]
    old.rename(old.with_name(old.name.replace(f".{stamp}.", f".{int(stamp) - 60:010d}.", 1)))
    resumed = TensorBoardWriter(tmp_path)
    resumed.on_start(_info(tmp_path, start=4))
    for step in range(5, 9):
        resumed.on_step({"step": step, "loss": 10.0 + step})
    resumed.on_end("completed")
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 15.0), (6, 16.0), (7, 17.0), (8, 18.0)]


def test_a_missing_tensorboard_package_does_not_fail_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    writer = TensorBoardWriter(tmp_path)
    writer.on_start(_info(tmp_path))
    writer.on_step({"step": 1, "loss": 1.0})
    writer.on_end("completed")
    assert "pip install tensorboard" in caplog.text and not any(tmp_path.iterdir())
