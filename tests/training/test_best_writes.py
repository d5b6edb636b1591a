"""The best weights of an adapter run are written in the background from a host copy: the files
hold the weights of the evaluation that chose them (not those of later steps), are the files
PEFT's own save writes, the marker comes after them, a failed write is raised in the training
thread, and a run reports its last best weights before it ends. Before the end-of-run generation
check decodes, the training state it no longer needs is freed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kestrel.config import config_from_dict
from kestrel.model.loader import load
from kestrel.training import best_writes
from kestrel.training.best import read_best
from kestrel.training.best_writes import BestWrites, adapter_entries, host_copy
from kestrel.training.checkpoints import CheckpointWriteError
from kestrel.training.metrics import Callback
from kestrel.training.run import run


def _peft_model(folder: Path):
    from peft import LoraConfig, get_peft_model

    model, _ = load(str(folder), 64, dtype="fp32")
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _fill_lora(model, value: float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(value)


def test_adapter_is_written_from_its_copy_while_training_goes_on(tiny_model_dir, tmp_path: Path) -> None:
    model = _peft_model(tiny_model_dir("llama"))
    _fill_lora(model, 0.25)
    model.save_pretrained(tmp_path / "peft")  # PEFT's own save of the same weights: the reference
    writes = BestWrites(tmp_path / "run")
    writes.save(10, "eval_loss", 1.5, model, None)
    _fill_lora(model, 9.0)  # the next steps change the weights before the write is done
    assert writes.written(wait=True) == 10 and writes.written(wait=True) is None  # reported once
    want = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "run" / "best" / "adapter" / "adapter_model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert any("lora_B" in k and torch.all(v == 0.25) for k, v in got.items())
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text()) == {
        "step": 10, "metric": "eval_loss", "value": 1.5}


def test_the_copy_holds_only_what_the_adapter_file_holds(tiny_model_dir) -> None:
    model = _peft_model(tiny_model_dir("llama"))
    entries = adapter_entries(model)
    assert entries and all("lora_A" in k or "lora_B" in k for k in entries), sorted(entries or {})[:4]
    assert all(isinstance(v, torch.nn.Parameter) for v in entries.values())  # live: later saves read them anew
    _fill_lora(model, 3.0)
    snap = host_copy(entries)
    assert all(v.device.type == "cpu" for v in snap.values())
    assert any("lora_B" in k and torch.all(v == 3.0) for k, v in snap.items())
    assert adapter_entries(load(str(tiny_model_dir("llama")), 64, dtype="fp32")[0]) is None  # a full model


def test_later_saves_copy_the_weights_of_their_own_evaluation(tiny_model_dir, tmp_path: Path) -> None:
    model = _peft_model(tiny_model_dir("llama"))
    writes = BestWrites(tmp_path)
    for step, value in ((10, 1.0), (20, 2.0)):
        _fill_lora(model, value)
        writes.save(step, "eval_loss", 1.0 / step, model, None)
    _fill_lora(model, 7.0)
    assert writes.written(wait=True) == 20
    got = load_file(str(tmp_path / "best" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.all(v == 2.0) for k, v in got.items() if "lora_B" in k)


def test_a_failed_background_write_is_raised_and_leaves_no_marker(tiny_model_dir, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model = _peft_model(tiny_model_dir("llama"))
    writes = BestWrites(tmp_path)
    writes.save(10, "eval_loss", 1.0, model, None)
    writes.wait()

    def full_disk(*a, **k):
        raise CheckpointWriteError("could not write the best weights: the disk is full")

    monkeypatch.setattr(best_writes, "save_weights", full_disk)
    writes.save(20, "eval_loss", 0.5, model, None)
    with pytest.raises(CheckpointWriteError, match="disk is full"):
        writes.save(30, "eval_loss", 0.4, model, None)  # the next save raises the write before it
    assert read_best(tmp_path) is None  # the marker went before the failed write: no half-described weights


class Bests(Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.steps, self.found = out, [], []

    def on_best(self, step: int, path: str) -> None:
        self.steps.append(step)
        self.found.append(read_best(self.out))


def test_a_run_reports_its_best_weights_once_written(tiny_model_dir, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = dict(model=str(tiny_model_dir("llama")), dataset="arithmetic_chat", output_dir=str(out), max_seq_length=64,
               batch_size=2, max_steps=9, learning_rate=1e-3, save_steps=0, seed=0, gradient_checkpointing="off",
               eval_split=0.1, eval_steps=3)
    bests = Bests(out)
    result = run(config_from_dict(cfg), [bests])
    assert result.status == "completed"
    marker = json.loads((out / "best" / "best.json").read_text())
    assert bests.steps and bests.steps[-1] == marker["step"]  # the last best is reported before the run ends
    assert len(set(bests.steps)) == len(bests.steps) and all(s in (3, 6, 9) for s in bests.steps)
    assert bests.found[-1] is not None and bests.found[-1]["step"] == marker["step"]


def _finished_run(model, optimizer, released: list[bool], check, output_dir: Path = Path(".")):
    """The RunState fields `recipe.generation_check` reads, for a run whose training is done;
    `released` records each release of the (stand-in) recompute's graphs."""
    from types import SimpleNamespace

    from kestrel.training.eval_schedule import EvalSchedule
    from kestrel.training.evaluation import EVAL_BUDGET

    schedule = EvalSchedule(1, True, EVAL_BUDGET)  # no step measured: the check has no time budget
    return SimpleNamespace(model=model, tokenizer=None, output_dir=output_dir, optimizer=optimizer,
                           recompute=SimpleNamespace(release=lambda: released.append(True)),
                           evaluator=SimpleNamespace(generation=check, schedule=schedule),
                           world=SimpleNamespace(is_main=True, size=1))


def test_the_training_state_is_freed_before_the_generation_check_decodes(tiny_model_dir, monkeypatch) -> None:
    """The optimizer's state, the gradients and the training's CUDA graphs go before the check's
    decode allocates its cache: they would add to the run's peak for nothing."""
    from kestrel.training import recipe
    from kestrel.training.generation_check import GenerationCheck

    model = _peft_model(tiny_model_dir("llama"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    released: list[bool] = []
    seen: dict[str, object] = {}

    def check_run(self, m, tokenizer, output_dir, step, seconds=None):  # what the decode would find
        seen.update(state=len(optimizer.state), grads=sum(p.grad is not None for p in params), released=list(released))
        return {"exact_match": 0.0, "rouge_l": 0.0, "seconds": seconds, "stopped_early": 0}

    monkeypatch.setattr(GenerationCheck, "run", check_run)
    s = _finished_run(model, optimizer, released, GenerationCheck([object()], 8))
    assert len(optimizer.state) == len(params)
    recipe.generation_check(s, Callback(), 4)
    assert seen == {"state": 0, "grads": 0, "released": [True]}


def test_a_check_out_of_gpu_memory_is_logged_and_the_completed_run_stands(tiny_model_dir, monkeypatch) -> None:
    """The check comes after the weights are saved: running out of memory there skips it with a
    message that says how to run it later, and frees what it took; it does not fail the run."""
    from types import SimpleNamespace

    from kestrel.training import recipe
    from kestrel.training.generation_check import GenerationCheck

    model = _peft_model(tiny_model_dir("llama"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    released: list[bool] = []

    def check_run(self, m, tokenizer, output_dir, step, seconds=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 832.00 MiB")

    monkeypatch.setattr(GenerationCheck, "run", check_run)
    s = _finished_run(model, optimizer, released, GenerationCheck([object()] * 3, 8), Path("/runs/r7"))
    logs: list[str] = []
    steps: list[dict] = []
    cb = SimpleNamespace(on_log=logs.append, on_step=steps.append)
    recipe.generation_check(s, cb, 40)  # no exception
    assert steps == [] and len(released) == 2  # nothing scored; freed before and again after
    assert len(logs) == 1 and "out of memory" in logs[0] and "3 held-out prompts" in logs[0]
    assert "python -m kestrel.training.check_run /runs/r7 --weights /runs/r7 --step 40" in logs[0]
