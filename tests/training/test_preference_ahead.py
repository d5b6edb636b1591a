"""The next step's reference pass is queued before this step's metrics are read
(`kestrel.training.preference.ahead`): a DPO run gives exactly the metrics of the same run scoring
each reference in its own step, every step after the first takes the queued pass, the queued pass
comes before the step's report, and runs whose reference could change with the update (full
fine-tuning, a trainable base parameter) or is precomputed queue nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kestrel.config import config_from_dict
from kestrel.training.metrics import Callback
from kestrel.training.preference import ahead as A
from kestrel.training.preference import score
from kestrel.training.run import run
from tests.training.test_preference_train import _config, _metrics, _subset

KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "grad_norm")


class Order(Callback):
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def on_step(self, metrics: dict) -> None:
        if "loss" in metrics:
            self.events.append(f"report {int(metrics['step'])}")


def _run(tmp_path: Path, model: str, name: str, events: list[str], **kw) -> list[dict]:
    data = _subset(tmp_path, "arithmetic_preferences", 16)
    cfg = _config(model, tmp_path / name, data, max_steps=4, grad_accum=2, batch_size=2, **kw)
    result = run(config_from_dict(cfg), [Order(events)])
    assert result.status == "completed", result.error
    return _metrics(tmp_path / name)


@pytest.mark.parametrize("checkpointing", ["off", "standard"])
def test_a_queued_reference_gives_the_same_run(tiny_model_dir, tmp_path: Path, monkeypatch, one_thread,
                                               checkpointing: str) -> None:
    model = str(tiny_model_dir("llama"))
    events: list[str] = []
    real_queue, real_take = A.Ahead.queue, A.Ahead.take

    def queue(self, s, step):
        events.append(f"queue {step + 1}")  # 1-based, as reported
        real_queue(self, s, step)

    def take(self, data, idx):
        got = real_take(self, data, idx)
        events.append("take" if got is not None else "miss")
        return got

    monkeypatch.setattr(A.Ahead, "queue", queue)
    monkeypatch.setattr(A.Ahead, "take", take)
    early = _run(tmp_path, model, "early", events, gradient_checkpointing=checkpointing)
    # steps 2-4 each take the pass queued during the step before, before that step was reported
    assert [e for e in events if e.startswith("queue")] == ["queue 2", "queue 3", "queue 4"]
    assert events.index("queue 2") < events.index("report 1") and events.index("queue 4") < events.index("report 3")
    assert events.count("take") == 3  # the first micro-batch of steps 2-4; the second ones are scored as before
    monkeypatch.setattr(A, "ahead_for", lambda s: None)
    monkeypatch.setattr("kestrel.training.preference.trainer.ahead_for", lambda s: None)
    plain = _run(tmp_path, model, "plain", [], gradient_checkpointing=checkpointing)
    assert len(early) == len(plain) == 4
    for a, b in zip(early, plain):
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
        assert a["tokens_per_s"] > 0


def test_nothing_is_queued_where_the_reference_may_change(tiny_model_dir, tmp_path: Path, monkeypatch, one_thread) -> None:
    made: list[object] = []
    real = A.ahead_for

    def spy(s):
        made.append(real(s))
        return made[-1]

    monkeypatch.setattr("kestrel.training.preference.trainer.ahead_for", spy)
    model = str(tiny_model_dir("llama"))
    _run(tmp_path, model, "orpo", [], method="orpo")  # no reference at all
    _run(tmp_path, model, "pre", [], preference={"precompute_ref_logps": True})
    _run(tmp_path, model, "full", [], preference={"finetune": "full"})
    assert made == [None, None, None]
    _run(tmp_path, model, "dpo", [])
    assert isinstance(made[-1], A.Ahead)


def test_a_trainable_base_parameter_keeps_the_reference_in_its_step(tiny_model_dir) -> None:
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora
    from kestrel.config import LoraSettings

    model, _ = load(str(tiny_model_dir("llama")), 64, dtype="fp32", device="cpu")
    for p in model.parameters():
        p.requires_grad_(False)
    model = attach_lora(model, LoraSettings(r=4, alpha=8))
    assert A.reference_is_frozen(model)
    next(p for n, p in model.named_parameters() if "norm" in n).requires_grad_(True)
    assert not A.reference_is_frozen(model)


def test_a_queued_pass_is_taken_once_and_only_for_its_own_rows() -> None:
    ahead = A.Ahead()
    rows = score.RowSet([object(), object(), object()])
    ahead.samples, ahead.idx, ahead.rows, ahead.ref = rows.samples, [0, 2], "rows", "ref"
    assert ahead.take(score.RowSet([object()]), [0, 2]) is None  # other data (the eval rows)
    assert ahead.take(score.RowSet(rows.samples), [0, 1]) is None  # another micro-batch
    assert ahead.take(score.RowSet(rows.samples), [0, 2]) == ("rows", "ref")
    assert ahead.take(score.RowSet(rows.samples), [0, 2]) is None  # once


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("checkpointing,graphs", [("standard", "off"), ("standard", "on"), ("offload", "on")])
def test_a_queued_reference_gives_the_same_run_on_cuda(tiny_model_dir, tmp_path: Path, monkeypatch,
                                                       checkpointing: str, graphs: str) -> None:
    """On CUDA the queued pass runs while the host reads the staged metrics (pinned copy behind an
    event): QLoRA in bf16, graphs forced one way so both runs take the same kernels."""
    model = str(tiny_model_dir("llama"))
    taken: list[bool] = []
    real_take = A.Ahead.take

    def take(self, data, idx):
        got = real_take(self, data, idx)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(A.Ahead, "take", take)
    kw = dict(gradient_checkpointing=checkpointing, dtype="bf16", preference={"finetune": "qlora"},
              performance={"cuda_graphs": graphs})
    early = _run(tmp_path, model, "early", [], **kw)
    assert taken.count(True) == 3
    monkeypatch.setattr("kestrel.training.preference.trainer.ahead_for", lambda s: None)
    plain = _run(tmp_path, model, "plain", [], **kw)
    for a, b in zip(early, plain, strict=True):
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key
