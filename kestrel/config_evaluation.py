"""The evaluation part of the training config: the held-out set, how often it is scored, early
stopping and where metrics are reported. `TrainConfig` holds the fields (TRL's names) and calls
`check_evaluation` from its own checks; kept apart so config.py stays one screenful of fields.

    eval_dataset: data/val.jsonl     # a file of held-out rows (same formats as `dataset`), or
    eval_split: 0.05                 # a seeded fraction of `dataset`'s rows, never trained on
    eval_steps: null                 # null: chosen so evaluation costs <= 5% of the training time
    early_stopping: {patience: 3, min_delta: 0.0}   # patience 0 = off
    report_to: [tensorboard, wandb]  # tensorboard event files are always written
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from kestrel.errors import ConfigError

REPORTERS = ("tensorboard", "wandb", "mlflow")
MAX_EVAL_SPLIT = 0.5  # past this the run holds out more than it trains on
MAX_PATIENCE = 1_000_000


@dataclass
class EarlyStoppingSettings:
    """Stop when `patience` evaluations in a row have not improved on the best eval metric (eval_loss;
    GRPO: eval_reward) by more than `min_delta` (patience 0 turns it off). Needs an evaluation set."""

    patience: int = 0
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.patience <= MAX_PATIENCE:
            raise ConfigError(f"early_stopping.patience must be 0..{MAX_PATIENCE:,} evaluations (0 = off), "
                              f"got {self.patience!r}")
        if not (math.isfinite(self.min_delta) and 0 <= self.min_delta <= 1e6):
            raise ConfigError(f"early_stopping.min_delta must be a number from 0 to 1e6, got {self.min_delta!r}")


def installed(module: str) -> bool:
    """Whether `module` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_evaluation(config: Any) -> None:
    """The evaluation fields of a TrainConfig: ranges, combinations and installed reporters."""
    split, steps = config.eval_split, config.eval_steps
    if not 0.0 <= split <= MAX_EVAL_SPLIT:
        raise ConfigError(f"eval_split must be a fraction from 0 to {MAX_EVAL_SPLIT} of the dataset's rows "
                          f"(0 = none), got {split!r}")
    if config.eval_dataset is not None and not str(config.eval_dataset).strip():
        raise ConfigError("eval_dataset must name a file of held-out rows, or be left out")
    if config.eval_dataset and split > 0:
        raise ConfigError("eval_dataset and eval_split both name an evaluation set; set only one "
                          "(eval_split holds rows of `dataset` out, eval_dataset reads another file)")
    if steps is not None and not 1 <= steps <= 10_000_000:
        raise ConfigError(f"eval_steps must be at least 1 (or null for the automatic interval), got {steps!r}")
    evaluates = bool(config.eval_dataset) or split > 0
    if config.early_stopping.patience and not evaluates:
        raise ConfigError("early_stopping needs an evaluation set: set eval_dataset (a file) or eval_split "
                          "(a fraction of dataset held out)")
    if steps is not None and not evaluates:
        raise ConfigError("eval_steps is set but there is no evaluation set: set eval_dataset or eval_split")
    for name in config.report_to:
        if name not in REPORTERS:
            raise ConfigError(f"report_to: unknown reporter {name!r}; valid: {', '.join(REPORTERS)}")
        if name != "tensorboard" and not installed(name):
            raise ConfigError(f"report_to: {name} is not installed in this Python environment; "
                              f"`pip install {name}`, or remove it from report_to")
