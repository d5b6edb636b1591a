"""Training checkpoints: written atomically, found again on resume.

    output_dir/checkpoints/step-000040/
        adapter/ (PEFT) or model/ (full fine-tuning), optimizer.pt, scheduler.pt, state.json

A checkpoint is written into `step-N.tmp` and renamed when complete, so a crash or a full disk
never leaves a half-written checkpoint under a final name, and the previous one stays intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kestrel.errors import KestrelError

KEEP = 2  # checkpoints kept; older ones are removed once a newer one is complete


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def save_weights(model: nn.Module, folder: Path, tokenizer: Any = None) -> Path:
    """The adapter (PEFT folder) or the full model, plus the tokenizer, into `folder`."""
    target = folder / ("adapter" if _is_peft(model) else "model")
    model.save_pretrained(target)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)
    return target


def save_checkpoint(
    output_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any]
) -> Path:
    root = output_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_weights(model, tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(output_dir)
        kept = f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
        raise KestrelError(
            f"could not write the checkpoint at step {step} to {root} ({exc.strerror or exc}); {kept}. "
            "Free disk space (or raise save_steps) and resume."
        ) from exc
    for old in sorted(root.glob("step-*[0-9]"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    done = [p for p in sorted((output_dir / "checkpoints").glob("step-*[0-9]")) if (p / "state.json").is_file()]
    return done[-1] if done else None


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """Restore weights, optimizer and scheduler from `path`; returns its state dict (with `step`)."""
    from safetensors.torch import load_file

    device = next(p for p in model.parameters()).device
    if _is_peft(model):
        from peft import set_peft_model_state_dict

        weights = load_file(str(path / "adapter" / "adapter_model.safetensors"), device=str(device))
        set_peft_model_state_dict(model, weights)
    else:
        loaded = type(model).from_pretrained(path / "model", dtype=next(model.parameters()).dtype)
        model.load_state_dict(loaded.state_dict())
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    return json.loads((path / "state.json").read_text())
