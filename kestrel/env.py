"""Every KESTREL_* environment variable Kestrel reads, and the one place that reads them.

A run's settings live in its config (`kestrel.config`, `performance:` for the speed switches), saved
with the run. These variables are where Kestrel lives, how the job runner shares the machine, and
overrides for debugging; nothing else in the package reads the environment for them.

| variable | meaning |
|---|---|
| KESTREL_HOME | the folder for models, datasets, runs and the job database (default ~/.kestrel) |
| KESTREL_CUDA_GRAPHS | 1 / 0 / auto: override a run's `performance.cuda_graphs` (debugging) |
| KESTREL_OFFLOAD_GATE | 0..1: override a run's `performance.offload_gate` (debugging) |
| KESTREL_KERNELS | triton / torch: force every fused op onto one implementation (debugging, tests) |
| KESTREL_PDL | 0 turns off programmatic dependent launches in the decode step (Hopper and later) |
| KESTREL_DEVICES | the devices jobs may use, "cpu" or "cuda:0,cuda:1" (default: every visible GPU) |
| KESTREL_JOBS_PER_DEVICE | training jobs at once on one device (default 1) |
| KESTREL_EXPORT_SLOTS | export jobs at once (default 1) |
| KESTREL_CANCEL_TIMEOUT_S | seconds a cancelled job gets to checkpoint before it is stopped (default 120) |
| KESTREL_KILL_GRACE_S | seconds after that before it is killed (default 10) |
| KESTREL_ENGINE_ENTRY | module:function a worker runs instead of `kestrel.training.run:run` (tests) |
| KESTREL_JOB_DEVICE | set by the job runner for a worker: the device its job was given |

Light on purpose: no torch import, so the command line and the studio start fast.
"""

from __future__ import annotations

import os

VARIABLES = (
    "KESTREL_HOME", "KESTREL_CUDA_GRAPHS", "KESTREL_OFFLOAD_GATE", "KESTREL_KERNELS", "KESTREL_PDL",
    "KESTREL_DEVICES", "KESTREL_JOBS_PER_DEVICE", "KESTREL_EXPORT_SLOTS", "KESTREL_CANCEL_TIMEOUT_S",
    "KESTREL_KILL_GRACE_S", "KESTREL_ENGINE_ENTRY", "KESTREL_JOB_DEVICE",
)


def raw(name: str) -> str:
    """The variable's value, stripped ("" when unset)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of Kestrel's variables (kestrel/env.py lists them)")
    return os.environ.get(name, "").strip()


def number(name: str, default: float) -> float:
    """A numeric variable, or `default` when unset; a clear error naming it when not a number."""
    value = raw(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


def choice(name: str, allowed: dict[str, str]) -> str | None:
    """A variable that names one of `allowed` (its spellings -> the meaning), None when unset."""
    value = raw(name).lower()
    if not value:
        return None
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid: use one of {', '.join(allowed)}")
    return allowed[value]


def job_environment(device: str) -> dict[str, str]:
    """What the job runner adds to a worker's environment."""
    return {"KESTREL_JOB_DEVICE": device}
