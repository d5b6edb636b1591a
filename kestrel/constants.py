"""Facts several rooms share, in a module light enough for any of them to import (no torch): the
command line and the studio import it without loading the engine."""

from __future__ import annotations

import copy
import re
import signal
from typing import Any

DEMO = "demo"  # the built-in demo model's name, in place of a hub id or a folder
GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo")  # sequence mean | token level | token level over a fixed length
# Rows of an MLP call past which its fused LoRA MLP defers the recompute to its backward, in
# chunks of this many rows (`kernels.lora.mlp`); the memory estimate models the same.
DEFERRED_ROWS = 2048
# `performance.defer_mlp`: when a recomputed MLP defers (`kestrel.recompute.mlp_deferral`)
DEFER_MODES = ("memory", "fit", "off")
# `performance.keep_attention`: when offloaded layers keep their attention output (`kestrel.model.kept_attention`)
KEEP_ATTENTION_MODES = ("off", "auto", "on")
# `performance.keep_projection`: whether a layer keeping its attention output keeps its output projection's too
KEEP_PROJECTION_MODES = ("off", "on")
# `performance.keep_qkv`: whether a layer keeping its attention output keeps its Q/K/V projections' outputs too
KEEP_QKV_MODES = ("off", "on")
# `performance.backward_graph_capture`: when a graphed layer's recompute-and-backward graph is captured
BACKWARD_CAPTURE_MODES = ("backward", "first_pass")
# `performance.capture_stream`: which stream the layer graphs are captured on (`kestrel.recompute.capture_stream`)
CAPTURE_STREAMS = ("side", "steps")
# `performance.cuda_allocator`: how torch's CUDA caching allocator grows its segments
CUDA_ALLOCATORS = ("expandable", "fixed")
# Dataset formats the reader knows (`kestrel.data.formats.FORMATS`, plus auto-detection), named
# here so a config is checked without importing the reader (tests/test_config_limits.py keeps
# the two lists equal).
DATASET_FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text")
# Preference methods (`kestrel.training.preference`) and their settings' choices, TRL's names.
PREFERENCE_METHODS = ("dpo", "orpo", "kto", "simpo")
# DPO's logistic loss | IPO's squared loss | SLiC's hinge | label-noise robust DPO | EXO | NCA | BCO (pairs)
# | SPPO (hard) | APO-zero | APO-down: TRL's loss_type names (`kestrel.training.preference.loss`)
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down")
SMOOTHED_LOSS_TYPES = ("robust", "exo_pair")  # the DPO losses that read label_smoothing (the chance a label is flipped)
PREFERENCE_FINETUNE = ("lora", "qlora", "full")  # what a preference method trains: an adapter, or every weight
# Paired rows: each prompt scored once for both answers (on), with each answer (off), or once where the model can (auto)
SHARE_PROMPT_MODES = ("auto", "on", "off")
# GRPO reward names (`kestrel.training.grpo.rewards`): the built-ins, and `custom` for a Python file.
REWARD_NAMES = ("exact_answer", "format_regex", "length_penalty", "json_valid", "custom")

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def slug(text: str, default: str, limit: int | None = None) -> str:
    """`text` as a file or folder name: runs of anything but letters, digits, `.`, `_` and `-`
    become one `-`; `default` when nothing is left."""
    out = _UNSAFE.sub("-", text).strip("-")
    return (out[:limit] if limit else out).strip("-") or default


def merge(base: dict[str, Any], extra: dict[str, Any], whole: tuple[str, ...] = ()) -> dict[str, Any]:
    """`base` with `extra` laid over it, nested mappings merged key by key, except the keys in
    `whole`, whose mapping `extra` replaces entirely; neither input is changed."""
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key not in whole:
            merged[key] = merge(merged[key], value, whole)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def signal_name(returncode: int) -> str | None:
    """The signal that ended a process, from its return code ("SIGKILL"), or None for an exit."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
