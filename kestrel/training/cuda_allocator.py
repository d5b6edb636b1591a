"""How a run's process sets torch's CUDA caching allocator: `performance.cuda_allocator`.

`expandable` (the default) turns on the allocator's expandable segments: a segment maps more pages as
it grows and unmaps the pages its freed blocks leave at its end, so reserved memory (what `nvidia-smi`
shows) follows what the run holds rather than keeping every fixed-size segment a step's peak carved.
Its CUDA graphs keep their private pool alive across drops (`kestrel.recompute.layer_graphs._pool_keeper`),
which expandable segments need. Measured against `fixed`, torch's own segments (bench/RESULTS.md,
session 39): the same speed, 0.2-0.5 GiB less reserved. Unsloth sets the same on import.

The setting goes through torch's runtime setter, before CUDA starts or after (new segments follow it): setting
torch's variable once torch is imported does not reach every torch version's allocator. Where the setter is
missing, torch's variable is set before CUDA starts (the ranks a run starts inherit it). An allocator setting
in torch's variables that names expandable segments is the user's own choice, and wins.
"""

from __future__ import annotations

import os

import torch

TORCH_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's (the second its older name)


def apply_cuda_allocator(mode: str) -> str:
    """Set this process's CUDA caching allocator as `mode` (expandable | fixed) says; returns what applies,
    for the run's log."""
    for name in TORCH_VARIABLES:
        given = os.environ.get(name, "")
        if "expandable_segments" in given:
            return f"as {name} sets it ({given})"
    if not torch.cuda.is_available():
        return "no CUDA device: nothing to set"
    setting = f"expandable_segments:{mode == 'expandable'}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        if torch.cuda.is_initialized():
            return f"torch's default segments: CUDA had started, and this torch cannot change them ({mode} asked)"
        given = os.environ.get(TORCH_VARIABLES[1], "")
        os.environ[TORCH_VARIABLES[1]] = f"{given},{setting}" if given else setting
        return f"{mode} segments (through {TORCH_VARIABLES[1]})"
    try:
        setter(setting)
    except RuntimeError as exc:
        return f"torch's default segments: {mode} refused ({exc})"
    return f"{mode} segments"
