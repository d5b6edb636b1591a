"""How a run's process sets torch's CUDA caching allocator: `performance.cuda_allocator`.

`expandable` (the default) turns on the allocator's expandable segments: a segment maps more pages as
it grows and unmaps the pages its freed blocks leave at its end, so reserved memory (what `nvidia-smi`
shows) follows what the run holds rather than keeping every fixed-size segment a step's peak carved.
Its CUDA graphs keep their private pool alive across drops (`kestrel.recompute.layer_graphs._pool_keeper`),
which expandable segments need. Measured against `fixed`, torch's own segments (bench/RESULTS.md,
session 39): the same speed, 0.2-0.5 GiB less reserved. Unsloth sets the same on import.

The setting must reach the allocator before it first reserves memory: through torch's own variable,
PYTORCH_CUDA_ALLOC_CONF, before CUDA starts in this process (inherited by the ranks it starts), or
through torch's runtime setter once CUDA has started (new segments follow it). A PYTORCH_CUDA_ALLOC_CONF
that already names expandable segments is the user's own choice, and wins.
"""

from __future__ import annotations

import os

import torch

TORCH_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"  # torch's, not Kestrel's: read here only to respect the user's


def apply_cuda_allocator(mode: str) -> str:
    """Set this process's CUDA caching allocator as `mode` (expandable | fixed) says; returns what applies,
    for the run's log."""
    given = os.environ.get(TORCH_VARIABLE, "")
    if "expandable_segments" in given:
        return f"as {TORCH_VARIABLE} sets it ({given})"
    if not torch.cuda.is_available():
        return "no CUDA device: nothing to set"
    setting = f"expandable_segments:{mode == 'expandable'}"
    if not torch.cuda.is_initialized():
        os.environ[TORCH_VARIABLE] = f"{given},{setting}" if given else setting
        return f"{mode} segments"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return f"torch's default segments: CUDA had started, and this torch cannot change them at run time ({mode} asked)"
    try:
        setter(setting)
    except RuntimeError as exc:
        return f"torch's default segments: {mode} refused ({exc})"
    return f"{mode} segments (set after CUDA had started: new segments follow it)"
