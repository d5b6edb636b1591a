"""Errors a user can act on. Each says what went wrong, where, and what to do."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


class KestrelError(Exception):
    """An error caused by the user's input or machine, with a message meant for them."""


class ConfigError(KestrelError):
    """A training config that cannot be run as written."""


class DatasetError(KestrelError):
    """A dataset file that cannot be read or used."""


class ModelLoadError(KestrelError):
    """A model that cannot be found or loaded."""


class TrainingDivergedError(KestrelError):
    """The loss or the gradients stopped being finite numbers; the run cannot go on."""


class OutOfMemoryError(KestrelError):
    """The GPU ran out of memory; the message says what to lower."""


def oom_message(batch_size: int, max_seq_length: int, gradient_checkpointing: str) -> str:
    """What to change after a CUDA out-of-memory error, given the settings that were used."""
    steps = [f"lower batch_size (now {batch_size}) and raise grad_accum to keep the same batch"]
    steps.append(f"lower max_seq_length (now {max_seq_length})")
    if gradient_checkpointing in ("off", "standard"):  # auto may have chosen offload already (the run's log says)
        steps.append("set gradient_checkpointing: offload (layer inputs kept in CPU memory)")
    return "GPU out of memory. To fit, " + "; or ".join(steps) + "."


def one_line(text: object, limit: int = 2000) -> str:
    """An error message as one line for a terminal: newlines and other control characters become
    a space, and a message past `limit` characters is cut (the command line promises one line)."""
    flat = _CONTROL.sub(" ", str(text)).strip()
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
