"""The SFT loop with the host a step ahead (`sft.runs_ahead`, on CUDA): step n is read and reported after
step n+1's forward and backward are queued and before its optimizer step, and the divergence guard stays
on the device (`recipe.guarded_step`). Forced on here (CPU), with torch's fused AdamW (CPU kernels), so the
guard path runs: the same losses, checkpoints and weights as step by step; a divergence stops at its own
step with nothing after it applied; a pause resumes to the same curve."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kestrel.config import config_from_dict
from kestrel.training import sft
from kestrel.training.recipe import guarded_step
from kestrel.training.run import run
from tests.training.test_train import StopAt, _cfg, _losses


class _FusedAdamW(torch.optim.AdamW):
    """AdamW with fused=True on any device, as the runs on CUDA get it."""

    def __init__(self, params, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, **{**kwargs, "fused": True})


@pytest.fixture
def ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sft, "runs_ahead", lambda device: True)
    monkeypatch.setattr(torch.optim, "AdamW", _FusedAdamW)


def _state(opt: torch.optim.Optimizer, p: torch.nn.Parameter) -> list[torch.Tensor]:
    return [p.detach().clone()] + [opt.state[p][k].clone() for k in ("step", "exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("loss,norm", [(math.nan, 1.0), (1.0, math.inf), (-math.inf, math.nan)])
def test_a_guarded_step_changes_nothing_unless_finite(loss: float, norm: float) -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6))
    fused = torch.optim.AdamW([p], lr=0.1, weight_decay=0.1, fused=True)
    twin = torch.nn.Parameter(p.detach().clone())
    plain = torch.optim.AdamW([twin], lr=0.1, weight_decay=0.1)
    for q, opt in ((p, fused), (twin, plain)):  # one ordinary step, so there are moments to keep
        q.grad = torch.linspace(-1, 1, 6)
        opt.step()
    before = _state(fused, p)
    p.grad = torch.ones(6)
    guarded_step(fused, torch.tensor(loss), torch.tensor(norm))
    assert all(torch.equal(a, b) for a, b in zip(_state(fused, p), before))
    assert not hasattr(fused, "found_inf")
    for q, opt in ((p, fused), (twin, plain)):  # a finite step updates as an unguarded one
        q.grad = torch.ones(6)
    guarded_step(fused, torch.tensor(2.0), torch.tensor(3.0))
    plain.step()
    torch.testing.assert_close(p.detach(), twin.detach())


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def test_ahead_trains_checkpoints_and_reports_as_step_by_step(tiny_model_dir, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model = str(tiny_model_dir("llama"))
    monkeypatch.setattr(torch.optim, "AdamW", _FusedAdamW)
    step_by_step = run(config_from_dict(_cfg(model, tmp_path / "a", max_steps=7, save_steps=3)))
    monkeypatch.setattr(sft, "runs_ahead", lambda device: True)
    ahead = run(config_from_dict(_cfg(model, tmp_path / "b", max_steps=7, save_steps=3)))
    assert (step_by_step.status, ahead.status, ahead.step) == ("completed", "completed", 7)
    assert _losses(tmp_path / "b") == pytest.approx(_losses(tmp_path / "a"), rel=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8)) and all(r["tokens_per_s"] > 0 for r in rows)
    for run_dir in ("a", "b"):
        assert sorted(p.name for p in (tmp_path / run_dir / "checkpoints").iterdir()) == ["step-000003", "step-000006"]
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ahead_a_divergence_stops_at_its_step_with_nothing_after_it_applied(tiny_model_dir, tmp_path: Path,
                                                                           ahead: None) -> None:
    cfg = config_from_dict(_cfg(str(tiny_model_dir("llama")), tmp_path / "run", max_steps=5, save_steps=1))
    cfg.weight_decay = math.inf  # the first update turns the weights to inf; step 2's loss is NaN
    result = run(cfg)
    assert result.status == "failed" and "training stopped at step 2" in result.error, result
    assert "weight_decay (now inf)" in result.error
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step-000001"]  # step 2 was read before step 3's update: no later checkpoint
    assert not (tmp_path / "run" / "adapter").exists()


def test_ahead_a_pause_resumes_to_the_same_curve(tiny_model_dir, tmp_path: Path, ahead: None) -> None:
    model = str(tiny_model_dir("qwen3"))
    straight = run(config_from_dict(_cfg(model, tmp_path / "straight", max_steps=9)))
    paused = run(config_from_dict(_cfg(model, tmp_path / "resumed", max_steps=9)), [StopAt(4)])
    assert (straight.status, paused.status, paused.step) == ("completed", "interrupted", 4)
    resumed = run(config_from_dict(_cfg(model, tmp_path / "resumed", max_steps=9)))
    assert resumed.status == "completed"
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 10))
    assert _losses(tmp_path / "resumed") == pytest.approx(_losses(tmp_path / "straight"), rel=1e-4)


@pytest.mark.parametrize("fused", [True, False], ids=["guard-on-device", "guard-on-host"])
def test_a_preference_divergence_stops_at_its_step(tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   fused: bool) -> None:
    """DPO reads its guard with the step's metrics (fused AdamW: the update skipped on the device), or
    before the update (otherwise): either way the run fails at the step whose loss is not finite."""
    if fused:
        monkeypatch.setattr(torch.optim, "AdamW", _FusedAdamW)
    cfg = config_from_dict(dict(model=str(tiny_model_dir("llama")), method="dpo", dataset="arithmetic_preferences",
                                output_dir=str(tmp_path / "run"), max_seq_length=64, batch_size=2, max_steps=4,
                                save_steps=1, seed=0, gradient_checkpointing="off", dtype="fp32"))
    cfg.weight_decay = math.inf
    result = run(cfg)
    assert result.status == "failed" and "training stopped at step 2" in result.error, result
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000001"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_queuing_a_steps_update_never_waits_for_the_gpu(tiny_model_dir, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The default on CUDA: `apply` (the clip, the guarded fused step, the values' copy to the host) runs under
    torch's sync check from the third step on and raises nothing, and the run completes with every step read."""
    real = sft.apply
    checked: list[int] = []

    def watched(s, step, t0, window):  # type: ignore[no-untyped-def]
        if step < 2:
            return real(s, step, t0, window)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(s, step, t0, window)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(step)

    monkeypatch.setattr(sft, "apply", watched)
    result = run(config_from_dict(_cfg(str(tiny_model_dir("llama")), tmp_path / "run", max_steps=6, dtype="bf16",
                                       gradient_checkpointing="offload")))
    assert result.status == "completed", result
    assert checked == [2, 3, 4, 5] and sft.runs_ahead(torch.device("cuda"))
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, 7))
