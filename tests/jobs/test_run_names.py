"""Runs are named after their model: a hub id's or folder's last part, and for the weights of an
earlier run (DPO or GRPO on top of a fine-tune) that run's name, not "model"."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobkit import config
from kestrel import jobs
from kestrel.paths import model_stem


@pytest.mark.parametrize(("model", "stem"), [
    ("Qwen/Qwen3-4B", "Qwen3-4B"),
    ("/data/models/llama-8b", "llama-8b"),
    ("/home/u/.kestrel/runs/job-3-demo-full/model", "demo-full"),
    ("/home/u/.kestrel/runs/job-12-demo-full/checkpoints/step-000040/model", "demo-full"),
    ("/home/u/.kestrel/runs/my-sft/model", "my-sft"),  # an output_dir of the user's own
    ("model", "model"),
])
def test_model_stem(model: str, stem: str) -> None:
    assert model_stem(model) == stem


def test_a_run_on_an_earlier_runs_weights_is_named_after_that_run(kestrel_home: Path, tiny_model_dir) -> None:
    import shutil

    weights = kestrel_home / "runs" / "job-1-demo-full" / "model"
    shutil.copytree(tiny_model_dir("llama"), weights)
    job_id = jobs.submit(config(model=str(weights), method="lora"), start=False)
    assert jobs.get_job(job_id).name == "demo-full-lora"
