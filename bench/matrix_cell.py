"""Kestrel's training step of one bench/matrix.py cell, as a measured cell runs it, for the step-analysis
scripts (bench/train.py --layout, bench/graph_memory.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.matrix import LAYOUTS, batch_loss, kestrel_model, plan_batches  # noqa: E402
from bench.matrix_models import build_model_dir  # noqa: E402
from bench.model_shapes import MODELS  # noqa: E402


def cell_step(name: str, method: str, layout: str, cuda_graphs: str = "auto", allocator: str | None = None,
              n_batches: int = 16, seed: int = 0) -> Callable[[], Any]:
    """Kestrel's training step of a matrix cell as a measured cell runs it (the run's CUDA allocator, `allocator`
    overriding it, set first; the product's checkpointing and batch plan), each call on the cell's next batch and
    returning it; `.model`, `.recompute` and `.allocator` (the setting applied)."""
    import torch

    from kestrel.config import PerformanceSettings
    from kestrel.recompute.capture_stream import steps_on, steps_stream
    from kestrel.training.cuda_allocator import apply_cuda_allocator

    applied = apply_cuda_allocator(allocator or PerformanceSettings.cuda_allocator)  # before anything reserves memory
    model, flat, recompute = kestrel_model(build_model_dir(name), method, LAYOUTS[layout], cuda_graphs)
    batches = [b.to(torch.device("cuda")) for b in plan_batches(layout, MODELS[name]["vocab_size"], flat, n_batches, seed)]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    model.train()  # checkpointing, and so its graphs, act in training only
    stepped = [0]
    # the steps' own stream under `performance.capture_stream: steps`, as the product's loop runs them
    stream = steps_stream(torch.device("cuda"), recompute.capture_stream) if recompute is not None else None

    def step() -> Any:
        b = batches[stepped[0] % len(batches)]
        stepped[0] += 1
        with steps_on(stream):
            batch_loss(model, b).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return b

    step.model, step.recompute, step.allocator = model, recompute, applied  # type: ignore[attr-defined]
    return step
