"""Errors a user can act on. Each says what went wrong, where, and what to do."""

from __future__ import annotations


class KestrelError(Exception):
    """An error caused by the user's input or machine, with a message meant for them."""


class ConfigError(KestrelError):
    """A training config that cannot be run as written."""


class DatasetError(KestrelError):
    """A dataset file that cannot be read or used."""


class ModelLoadError(KestrelError):
    """A model that cannot be found or loaded."""


class OutOfMemoryError(KestrelError):
    """The GPU ran out of memory; the message says what to lower."""


def oom_message(batch_size: int, max_seq_length: int, gradient_checkpointing: str) -> str:
    """What to change after a CUDA out-of-memory error, given the settings that were used."""
    steps = [f"lower batch_size (now {batch_size}) and raise grad_accum to keep the same batch"]
    steps.append(f"lower max_seq_length (now {max_seq_length})")
    if gradient_checkpointing != "offload":
        steps.append("set gradient_checkpointing: offload (layer inputs kept in CPU memory)")
    return "GPU out of memory. To fit, " + "; or ".join(steps) + "."
