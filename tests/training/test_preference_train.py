"""Preference methods end to end on the CPU: DPO's reward accuracy and margin rise, every method
reports TRL's metric names, resume continues the straight run, full fine-tuning precomputes its
reference, and the shipped demo config runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kestrel.config import config_from_dict, load_config
from kestrel.paths import ASSETS, SAMPLE_DATASETS
from kestrel.training.run import run
from tests.training.test_train import StopAt

PAIRED_KEYS = ("step", "total_steps", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "eta_s",
               "vram_peak_gib", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
               "logps/chosen", "logps/rejected", "shared_prompt")



def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _subset(tmp_path: Path, name: str, rows: int) -> str:
    lines = (SAMPLE_DATASETS / f"{name}.jsonl").read_text().splitlines()[:rows]
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _config(model: str, out: Path, dataset: str, method: str = "dpo", **kw) -> dict:
    base = dict(model=model, method=method, dataset=dataset, output_dir=str(out), max_seq_length=64, batch_size=4,
                max_steps=4, learning_rate=3e-3, save_steps=0, seed=0, gradient_checkpointing="off", dtype="fp32",
                lr_scheduler="constant", lora={"r": 8, "alpha": 16})
    return {**base, **kw}


def test_dpo_learns_the_preferred_answers(tiny_model_dir, tmp_path: Path, one_thread) -> None:
    """16 arithmetic pairs (right vs wrong worked answer), 4 pairs a step, 24 steps: the policy moves
    the chosen answers up against the rejected ones, relative to the reference."""
    data = _subset(tmp_path, "arithmetic_preferences", 16)
    result = run(config_from_dict(_config(str(tiny_model_dir("llama")), tmp_path / "dpo", data, max_steps=24)))
    assert result.status == "completed", result.error
    m = _metrics(tmp_path / "dpo")
    for key in PAIRED_KEYS:
        assert key in m[0], key
    assert m[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # the adapter starts as the identity
    assert m[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # -log sigmoid(0)
    early = lambda key: sum(x[key] for x in m[:4]) / 4  # noqa: E731
    late = lambda key: sum(x[key] for x in m[-4:]) / 4  # noqa: E731
    assert late("rewards/accuracies") > max(0.9, early("rewards/accuracies") + 0.3), m
    assert late("rewards/margins") > early("rewards/margins") + 0.5, m
    assert late("loss") < early("loss") - 0.2
    assert (tmp_path / "dpo" / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize("method, extra", [("orpo", ("nll_loss", "log_odds_ratio")), ("simpo", ()),
                                           ("kto", ("kl",))])
def test_each_method_reports_trl_metric_names(tiny_model_dir, tmp_path: Path, one_thread, method, extra) -> None:
    name = "arithmetic_kto" if method == "kto" else "arithmetic_preferences"
    cfg = _config(str(tiny_model_dir("llama")), tmp_path / method, _subset(tmp_path, name, 12), method, max_steps=2,
                  preference={"precompute_ref_logps": method == "kto"})
    result = run(config_from_dict(cfg))
    assert result.status == "completed", result.error
    last = _metrics(tmp_path / method)[-1]
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins") + extra
    for key in keys:
        assert key in last and last[key] == last[key], key  # present and not NaN
    assert ("shared_prompt" in last) == (method != "kto")  # the layout of paired rows that ran (0 here: no varlen kernel)
    assert last.get("shared_prompt", 0.0) == 0.0


@pytest.mark.parametrize("loss_type, smoothing, first_loss", [
    ("exo_pair", 0.2, math.log(0.5) - 0.5 * math.log(0.2 * 0.8)),  # q = 1/2 against the target [0.8, 0.2]
    ("apo_zero", 0.0, 1.0),  # 1 - sigma(0) + sigma(0)
    ("sppo_hard", 0.0, 2 * (0.5 / 0.1) ** 2),  # both log-ratios 0, their targets +-1 / (2 beta)
])
def test_dpo_loss_variants_start_where_their_definition_says(tiny_model_dir, tmp_path: Path, one_thread, loss_type,
                                                             smoothing, first_loss) -> None:
    """The adapter starts as the identity, so every log-ratio is 0 at step 1: the loss there is the
    variant's value at 0 (with the config's label_smoothing reaching it), and it falls."""
    cfg = _config(str(tiny_model_dir("llama")), tmp_path / loss_type, _subset(tmp_path, "arithmetic_preferences", 12),
                  max_steps=6, preference={"loss_type": loss_type, "label_smoothing": smoothing})
    result = run(config_from_dict(cfg))
    assert result.status == "completed", result.error
    m = _metrics(tmp_path / loss_type)
    assert m[0]["loss"] == pytest.approx(first_loss, rel=1e-5)
    assert min(x["loss"] for x in m[1:]) < m[0]["loss"]


def test_resume_continues_the_straight_run(tiny_model_dir, tmp_path: Path, one_thread) -> None:
    model, data = str(tiny_model_dir("llama")), _subset(tmp_path, "arithmetic_preferences", 12)
    straight = run(config_from_dict(_config(model, tmp_path / "a", data)))
    paused = run(config_from_dict(_config(model, tmp_path / "b", data)), [StopAt(2)])
    assert (straight.status, paused.status, paused.step) == ("completed", "interrupted", 2)
    assert run(config_from_dict(_config(model, tmp_path / "b", data))).status == "completed"
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [x["step"] for x in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        for key in ("loss", "rewards/margins", "logps/chosen"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key


def test_full_finetuning_precomputes_the_reference(tiny_model_dir, tmp_path: Path, one_thread) -> None:
    """No adapter to disable: the reference log-probs are taken once from the weights as loaded;
    the precomputed and the per-step reference agree for LoRA."""
    model, data = str(tiny_model_dir("llama")), _subset(tmp_path, "arithmetic_preferences", 8)
    logs: list[str] = []

    class Logs(StopAt):
        def on_log(self, message: str) -> None:
            logs.append(message)

    full = run(config_from_dict(_config(model, tmp_path / "full", data, max_steps=3, learning_rate=1e-3,
                                        preference={"finetune": "full"})), [Logs(99)])
    assert full.status == "completed", full.error
    assert any("precomputed" in line and "no adapter" in line for line in logs), logs
    assert _metrics(tmp_path / "full")[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert (tmp_path / "full" / "model").is_dir()
    runs = {}
    for pre in (False, True):
        out = tmp_path / f"lora-{pre}"
        assert run(config_from_dict(_config(model, out, data, max_steps=3,
                                            preference={"precompute_ref_logps": pre}))).status == "completed"
        runs[pre] = _metrics(out)
    for x, y in zip(runs[False], runs[True]):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-6)


def test_checkpointing_modes_give_the_same_steps(tiny_model_dir, tmp_path: Path, one_thread) -> None:
    """The policy forward through off / standard / offload checkpointing, the reference pass
    (adapter disabled, no gradient) between them: identical runs (KTO: its KL rows too)."""
    model = str(tiny_model_dir("llama"))
    for method, name in (("dpo", "arithmetic_preferences"), ("kto", "arithmetic_kto")):
        data, curves = _subset(tmp_path, name, 8), {}
        for mode in ("off", "standard", "offload"):
            out = tmp_path / f"{method}-{mode}"
            cfg = _config(model, out, data, method, max_steps=3, gradient_checkpointing=mode)
            assert run(config_from_dict(cfg)).status == "completed"
            curves[mode] = [m[k] for m in _metrics(out) for k in ("loss", "rewards/chosen", "grad_norm")]
        assert curves["off"][-2] != 0  # the adapter moved: the comparison is not of zeros
        assert curves["standard"] == pytest.approx(curves["off"], rel=1e-5, abs=1e-9), method
        assert curves["offload"] == pytest.approx(curves["off"], rel=1e-5, abs=1e-9), method


def test_demo_dpo_config_parses() -> None:
    cfg = load_config(ASSETS / "configs" / "demo_dpo.yaml")
    assert cfg.method == "dpo" and cfg.dataset == "arithmetic_preferences"
    assert (SAMPLE_DATASETS / "arithmetic_preferences.jsonl").is_file()


def test_qlora_without_a_gpu_names_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = _config("demo", tmp_path / "q", "arithmetic_preferences", preference={"finetune": "qlora"})
    result = run(config_from_dict(cfg))
    assert result.status == "failed" and "set preference.finetune: lora" in result.error
