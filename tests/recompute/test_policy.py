"""`gradient_checkpointing: auto` (`kestrel.recompute.policy`, `kestrel.training.recipe.checkpointing_for`):
offload on one GPU where its pinned pages fit the RAM, standard elsewhere, each with its reason; the
run logs the choice and records it in performance.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel.config import TrainConfig, config_from_dict
from kestrel.recompute.policy import choose_checkpointing
from kestrel.training import recipe
from kestrel.training.distributed import World
from kestrel.training.run import run
from tests.support.logs import Logs

GIB = 2**30


def test_auto_is_the_default() -> None:
    assert TrainConfig().gradient_checkpointing == "auto"


@pytest.mark.parametrize("on_cuda,devices,need,ram,mode,why", [
    (False, 1, 1 * GIB, 64 * GIB, "standard", "no CUDA device"),
    (True, 4, 1 * GIB, 64 * GIB, "standard", "4 GPUs"),
    (True, 1, 4 * GIB, 64 * GIB, "offload", "4.0 GiB of this machine's 64.0 GiB RAM"),
    (True, 1, 60 * GIB, 64 * GIB, "standard", "would pin 60.0 GiB"),  # "tight" is not room enough
    (True, 1, None, 64 * GIB, "standard", "what offloading would pin is unknown"),
    (True, 1, 4 * GIB, None, "standard", "this machine's RAM is unknown"),
])
def test_the_rule(on_cuda: bool, devices: int, need: int | None, ram: int | None, mode: str, why: str) -> None:
    got, reason = choose_checkpointing(on_cuda, devices, need, ram)
    assert got == mode and why in reason, reason


def test_a_cpu_run_logs_and_records_the_choice(tiny_model_dir, tmp_path: Path) -> None:
    log = Logs()
    cfg = config_from_dict(dict(model=str(tiny_model_dir("llama")), dataset="arithmetic_chat", output_dir=str(tmp_path / "r"),
                                max_steps=1, max_seq_length=64, save_steps=0, dtype="fp32", method="lora"))
    assert run(cfg, [log]).status == "completed"
    assert any(line.startswith("gradient checkpointing standard (auto): no CUDA device") for line in log.lines), log.lines
    made = json.loads((tmp_path / "r" / "performance.json").read_text())["gradient_checkpointing"]
    assert made["requested"] == "auto" and made["mode"] == "standard" and "no CUDA" in made["reason"]


def test_one_gpu_weighs_the_runs_own_offload_need(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The need is the estimate of this run's settings (longer rows pin more); several ranks or a
    mode named in the config skip the estimate."""
    from kestrel.model.loader import load

    model, _ = load(str(tiny_model_dir("llama")), 64, dtype="fp32", device="cpu")
    monkeypatch.setattr(recipe, "on_cuda_device", lambda m: True)
    seen: list[tuple] = []
    monkeypatch.setattr(recipe, "choose_checkpointing", lambda *a: seen.append(a) or ("offload", "why"))
    monkeypatch.setattr(recipe, "detect_host_memory", lambda: 64 * GIB)
    for length in (64, 256):
        assert recipe.checkpointing_for(TrainConfig(max_seq_length=length), model, World()) == ("offload", "why")
    (on_cuda, devices, short, ram), (_, _, long, _) = seen
    assert on_cuda and devices == 1 and ram == 64 * GIB and 0 < short < long
    assert recipe.checkpointing_for(TrainConfig(gradient_checkpointing="standard"), model, World()) == (
        "standard", "set in the run's config")
    assert len(seen) == 2
