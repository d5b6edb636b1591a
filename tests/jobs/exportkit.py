"""A finished run to export, made cheaply: a LoRA adapter of the built-in demo model with random
weights, saved as training saves it, and a completed job pointing at it. Shared by the jobs and
studio export tests (self-contained: imported as `exportkit` or `tests.jobs.exportkit`)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from sqlalchemy import update

from kestrel import jobs
from kestrel.jobs.models import COMPLETED, Job
from kestrel.jobs.store import reset_engines, session


def lora_run(folder: Path) -> Path:
    """`folder` as a finished LoRA run leaves it: adapter/ (its adapter_config.json names the demo
    model as base) and config.yaml. Built in this process: a few seconds, torch included.

    lora_B is random, not zero as after attach: a trained adapter changes the model's answers,
    and the export's checks compare against exactly that change."""
    import torch

    from kestrel.training.checkpoints import save_weights
    from kestrel.config import LoraSettings, config_from_dict
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora

    model, tokenizer = load("demo", 256, patch=False)
    model = attach_lora(model, LoraSettings(r=4, alpha=8))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    save_weights(model, folder, tokenizer)
    config_from_dict({"model": "demo", "dataset": "arithmetic_chat", "output_dir": str(folder)}).save(
        folder / "config.yaml")
    return folder


def completed_run(folder: Path, name: str = "tuned") -> int:
    """A completed training job whose output_dir is `folder`; returns its id."""
    job_id = jobs.submit({"model": "demo", "dataset": "arithmetic_chat", "max_steps": 1, "name": name,
                          "output_dir": str(folder)}, start=False)
    with session(immediate=True) as s:
        s.execute(update(Job).where(Job.id == job_id).values(status=COMPLETED, finished_at=time.time()))
    return job_id


def finished_run_in(home: Path, name: str = "tuned") -> int:
    """A completed LoRA run in `home`'s job store and runs/ folder (KESTREL_HOME meanwhile), for
    a module-scoped fixture; returns its job id."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KESTREL_HOME", str(home))
        reset_engines()
        job_id = completed_run(lora_run(home / "runs" / name), name)
        reset_engines()
    return job_id


def checkpoint_in(run: Path, step: int, sign: float) -> Path:
    """run/checkpoints/step-N as training leaves it (adapter/ and state.json), its adapter the
    run's with lora_B times `sign` (-1: other answers than the final weights)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder = run / "checkpoints" / f"step-{step:06d}"
    shutil.copytree(run / "adapter", folder / "adapter")
    weights = folder / "adapter" / "adapter_model.safetensors"
    save_file({k: v * sign if "lora_B" in k else v for k, v in load_file(weights).items()}, weights)
    (folder / "state.json").write_text(json.dumps({"step": step}))
    return folder


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
