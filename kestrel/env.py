"""Every KESTREL_* environment variable Kestrel reads, and the one place that reads them.

A run's settings live in its config (`kestrel.config`, `performance:` for the speed switches), saved
with the run. These variables are where Kestrel lives, how the job runner shares the machine, and
overrides for debugging; nothing else in the package reads the environment for them.

| variable | meaning |
|---|---|
| KESTREL_HOME | the folder for models, datasets, runs and the job database (default ~/.kestrel) |
| KESTREL_CUDA_GRAPHS | 1 / 0 / auto: override a run's `performance.cuda_graphs` (debugging) |
| KESTREL_OFFLOAD_GATE | 0..1: override a run's `performance.offload_gate` (debugging) |
| KESTREL_DEFER_MLP | memory / fit / off: override a run's `performance.defer_mlp` (debugging) |
| KESTREL_KEEP_ATTENTION | off / auto / on: override a run's `performance.keep_attention` (debugging) |
| KESTREL_KEEP_PROJECTION | off / on: override a run's `performance.keep_projection` (debugging) |
| KESTREL_KEEP_QKV | off / on: override a run's `performance.keep_qkv` (debugging) |
| KESTREL_BACKWARD_CAPTURE | backward / first_pass: override a run's `performance.backward_graph_capture` (debugging) |
| KESTREL_CAPTURE_STREAM | side / steps: override a run's `performance.capture_stream` (debugging) |
| KESTREL_KERNELS | triton / torch: force every fused op onto one implementation (debugging, tests) |
| KESTREL_PDL | 0 turns off programmatic dependent launches in the decode step (Hopper and later) |
| KESTREL_DEVICES | the devices jobs may use, "cpu" or "cuda:0,cuda:1" (default: every visible GPU) |
| KESTREL_JOBS_PER_DEVICE | training jobs at once on one device (default 1) |
| KESTREL_EXPORT_SLOTS | export jobs at once (default 1) |
| KESTREL_CANCEL_TIMEOUT_S | seconds a cancelled job gets to checkpoint before it is stopped (default 120) |
| KESTREL_KILL_GRACE_S | seconds after that before it is killed (default 10) |
| KESTREL_ENGINE_ENTRY | module:function a worker runs instead of `kestrel.training.run:run` (tests) |
| KESTREL_JOB_DEVICE | set by the job runner for a worker: the device its job was given |
| KESTREL_HOST_GPUS | set by the job runner for a worker: its launcher's CUDA_VISIBLE_DEVICES ("all", "none") |

Light on purpose: no torch import, so the command line and the studio start fast.
"""

from __future__ import annotations

import os

VARIABLES = (
    "KESTREL_HOME", "KESTREL_CUDA_GRAPHS", "KESTREL_OFFLOAD_GATE", "KESTREL_DEFER_MLP", "KESTREL_KEEP_ATTENTION",
    "KESTREL_KEEP_PROJECTION", "KESTREL_KEEP_QKV", "KESTREL_BACKWARD_CAPTURE", "KESTREL_CAPTURE_STREAM",
    "KESTREL_KERNELS", "KESTREL_PDL",
    "KESTREL_DEVICES", "KESTREL_JOBS_PER_DEVICE", "KESTREL_EXPORT_SLOTS", "KESTREL_CANCEL_TIMEOUT_S",
    "KESTREL_KILL_GRACE_S", "KESTREL_ENGINE_ENTRY", "KESTREL_JOB_DEVICE", "KESTREL_HOST_GPUS",
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


def override(name: str, configured: str, modes: tuple[str, ...]) -> str:
    """A run setting whose modes are `modes`: the variable `name`, when set to one of them (a
    debugging override), wins over `configured`."""
    forced = choice(name, {m: m for m in modes})
    return configured if forced is None else forced


def choice(name: str, allowed: dict[str, str]) -> str | None:
    """A variable that names one of `allowed` (its spellings -> the meaning), None when unset."""
    value = raw(name).lower()
    if not value:
        return None
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid: use one of {', '.join(allowed)}")
    return allowed[value]


def job_environment(device: str, host_gpus: str | None) -> dict[str, str]:
    """What the job runner adds to a worker's environment: its device, and the GPUs its launcher saw
    (`host_gpus`: a CUDA_VISIBLE_DEVICES value, None when unset)."""
    return {"KESTREL_JOB_DEVICE": device,
            "KESTREL_HOST_GPUS": "all" if host_gpus is None else (host_gpus.strip() or "none")}


def host_gpus() -> str | None:
    """The CUDA_VISIBLE_DEVICES of the process that launched the first job of this chain (None:
    unset): in a worker (and its supervisor, which starts the next job) CUDA_VISIBLE_DEVICES names
    only its own job's GPUs, so jobs it starts are placed by what its launcher saw."""
    inherited = raw("KESTREL_HOST_GPUS")
    if not inherited:
        return os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if inherited == "all" else ("" if inherited == "none" else inherited)
