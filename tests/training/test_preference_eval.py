"""Evaluation of the preference methods: the held-out split (seeded, disjoint, before tokenizing),
an eval file in another layout, eval_loss and TRL's eval metric names against a one-batch manual
computation, the precomputed reference for the eval rows, early stopping with the best weights."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kestrel.config import config_from_dict
from kestrel.model.loader import load
from kestrel.model.lora import attach_lora
from kestrel.training.distributed import World
from kestrel.training.metrics import Callback
from kestrel.training.preference import loss as L
from kestrel.training.preference.data import prepare_samples
from kestrel.training.preference.evaluation import preference_evaluator
from kestrel.training.preference.reference import adapter_layers, as_reference, sequence_logps
from kestrel.training.preference.score import RowSet
from kestrel.training.run import run
from tests.training.test_preference_train import _config, _metrics, _subset
from tests.support.logs import Logs


def test_config_accepts_an_evaluation_set_for_every_preference_method(tmp_path: Path) -> None:
    for method in ("dpo", "orpo", "simpo", "kto"):
        cfg = config_from_dict(_config("demo", tmp_path, "arithmetic_preferences", method, eval_split=0.1,
                                       eval_steps=5, early_stopping={"patience": 2}))
        assert cfg.eval_split == 0.1 and cfg.early_stopping.patience == 2


def test_split_is_seeded_disjoint_and_made_before_tokenizing(demo_tokenizer, tmp_path: Path) -> None:
    data = _subset(tmp_path, "arithmetic_preferences", 40)
    cfg = config_from_dict(_config("demo", tmp_path / "o", data, eval_split=0.25))
    a = prepare_samples(cfg, demo_tokenizer, Logs())
    b = prepare_samples(cfg, demo_tokenizer, Logs())
    train, held = {s.line for s in a.train}, {s.line for s in a.held}
    assert len(held) == 10 and not train & held and train | held == set(range(1, 41))
    assert [s.line for s in b.held] == [s.line for s in a.held]  # the same seed holds the same rows out
    assert [r.line for r in a.held_rows] == [s.line for s in a.held]
    other = prepare_samples(config_from_dict(_config("demo", tmp_path / "o", data, eval_split=0.25, seed=1)),
                            demo_tokenizer, Logs())
    assert {s.line for s in other.held} != held


def test_eval_dataset_may_use_another_layout(demo_tokenizer, tmp_path: Path) -> None:
    """Training rows as text columns, eval rows in Anthropic HH's transcript layout."""
    hh = tmp_path / "hh.jsonl"
    hh.write_text("".join(json.dumps({"chosen": f"\n\nHuman: What is {i} + 1?\n\nAssistant: {i + 1}.",
                                      "rejected": f"\n\nHuman: What is {i} + 1?\n\nAssistant: {i + 2}."}) + "\n"
                          for i in range(5)))
    cfg = config_from_dict(_config("demo", tmp_path / "o", _subset(tmp_path, "arithmetic_preferences", 12),
                                   eval_dataset=str(hh)))
    logs = Logs()
    data = prepare_samples(cfg, demo_tokenizer, logs)
    assert len(data.train) == 12 and len(data.held) == 5
    assert data.held_rows[0].chosen[-1]["content"] == "1."
    assert any("eval_dataset" in line and "transcript" in line for line in logs.lines), logs.lines


@pytest.mark.parametrize("method, steps, batch, accum", [("dpo", 40, 2, 1), ("kto", 300, 4, 2), ("orpo", 1000, 8, 1)])
def test_default_interval_keeps_eval_within_5_percent_of_training_tokens(demo_tokenizer, tmp_path: Path, method,
                                                                         steps, batch, accum) -> None:
    """Tokens through the policy, as the loop draws micro-batches and as evaluations score the
    eval rows (the reference and KTO's KL passes run per row in both, so they cancel)."""
    from kestrel.training.evaluation import EVAL_BUDGET
    from kestrel.training.preference.data import micro_batch
    from kestrel.training.preference.evaluation import eval_rows, row_tokens

    name = "arithmetic_kto" if method == "kto" else "arithmetic_preferences"
    cfg = config_from_dict(_config("demo", tmp_path / "o", name, method, eval_split=0.3, batch_size=batch,
                                   grad_accum=accum, max_steps=steps))
    data = prepare_samples(cfg, demo_tokenizer, Logs())
    rows = eval_rows(cfg, data.train, data.held, steps)
    s = SimpleNamespace(config=cfg, samples=data.train, tokenizer=demo_tokenizer, total_steps=steps, start_step=0,
                        output_dir=tmp_path, paired=method != "kto", device=torch.device("cpu"), world=World())
    ev = preference_evaluator(s, RowSet(rows), data.held, data.held_rows, Logs())
    per_eval = sum(row_tokens(rows[i]) for b in ev.batches for i in b)
    trained = sum(row_tokens(data.train[i]) for m in range(steps * accum)
                  for i in micro_batch(len(data.train), batch, cfg.seed, m))
    evaluations = sum(ev.due(step, steps) for step in range(1, steps + 1))
    assert evaluations >= 1 and per_eval > 0 and len(rows) <= len(data.held)
    assert evaluations * per_eval <= EVAL_BUDGET * trained, (evaluations, per_eval, trained, ev.plan)


def _session(tiny_model_dir, tmp_path: Path, method: str, name: str, **kw):
    """A session-like run state over a LoRA model whose adapter is moved off the identity."""
    cfg = config_from_dict(_config(str(tiny_model_dir("llama")), tmp_path / "out", _subset(tmp_path, name, 16),
                                   method, eval_split=0.5, eval_steps=1, **kw))
    model, tokenizer = load(cfg.model, cfg.max_seq_length, dtype="fp32")
    model = attach_lora(model, cfg.lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    data = prepare_samples(cfg, tokenizer, Logs())
    s = SimpleNamespace(config=cfg, model=model, tokenizer=tokenizer, samples=data.train, pad_id=0,
                        device=torch.device("cpu"), flat=False, share_prompt=False, total_steps=4, start_step=0,
                        output_dir=tmp_path / "out", paired=method != "kto", world=World(),
                        adapter_layers=adapter_layers(model))
    s.output_dir.mkdir(parents=True, exist_ok=True)
    return s, data


def test_dpo_eval_metrics_equal_one_batch_over_every_held_out_pair(tiny_model_dir, tmp_path: Path, one_thread) -> None:
    """8 held-out pairs in micro-batches of 3 (the last one short): the evaluator's means over
    pairs equal DPO's loss and rewards computed over all 8 pairs at once."""
    s, data = _session(tiny_model_dir, tmp_path, "dpo", "arithmetic_preferences", batch_size=3)
    ev = preference_evaluator(s, RowSet(data.held), data.held, data.held_rows, Logs())
    assert len(ev.batches) == 3
    got = ev.evaluate(s.model)
    rows = [(x.prompt, x.answers[k]) for k in range(2) for x in data.held]
    with torch.no_grad():
        pol = sequence_logps(s.model, rows, 0, s.device, False)
        with as_reference(s.model):
            ref = sequence_logps(s.model, rows, 0, s.device, False)
    n, beta = len(data.held), s.config.preference.beta
    want = L.dpo_loss(pol[:n], pol[n:], ref[:n], ref[n:], beta, "sigmoid", torch.ones(n), torch.ones(n))
    assert got["eval_loss"] == pytest.approx(float(want.loss), rel=1e-5)
    assert got["eval_rewards/chosen"] == pytest.approx(float(want.chosen_rewards.mean()), rel=1e-4, abs=1e-6)
    assert got["eval_rewards/rejected"] == pytest.approx(float(want.rejected_rewards.mean()), rel=1e-4, abs=1e-6)
    margins = want.chosen_rewards - want.rejected_rewards
    assert got["eval_rewards/margins"] == pytest.approx(float(margins.mean()), rel=1e-4, abs=1e-6)
    assert got["eval_rewards/accuracies"] == pytest.approx(float((margins > 0).float().mean()))
    assert got["eval_logps/chosen"] == pytest.approx(float(pol[:n].mean()), rel=1e-5)
    assert got["eval_logps/rejected"] == pytest.approx(float(pol[n:].mean()), rel=1e-5)
    assert abs(got["eval_rewards/margins"]) > 1e-4  # the adapter is off the identity: a real test


def test_kto_eval_reports_kl_and_rewards_over_their_own_rows(tiny_model_dir, tmp_path: Path, one_thread) -> None:
    s, data = _session(tiny_model_dir, tmp_path, "kto", "arithmetic_kto", batch_size=4)
    from kestrel.training.preference.data import kl_partners

    held = RowSet(data.held, partner=kl_partners(len(data.held), 0))
    got = preference_evaluator(s, held, data.held, data.held_rows, Logs()).evaluate(s.model)
    labels = torch.tensor([bool(x.label) for x in data.held])
    with torch.no_grad():
        rows = [(x.prompt, x.answers[0]) for x in data.held]
        pol = sequence_logps(s.model, rows, 0, s.device, False)
        with as_reference(s.model):
            ref = sequence_logps(s.model, rows, 0, s.device, False)
    rewards = s.config.preference.beta * (pol - ref)
    assert 0 < int(labels.sum()) < len(labels)
    assert got["eval_rewards/chosen"] == pytest.approx(float(rewards[labels].mean()), rel=1e-4, abs=1e-6)
    assert got["eval_rewards/rejected"] == pytest.approx(float(rewards[~labels].mean()), rel=1e-4, abs=1e-6)
    assert got["eval_rewards/margins"] == pytest.approx(got["eval_rewards/chosen"] - got["eval_rewards/rejected"])
    assert "eval_kl" in got and got["eval_kl"] >= 0 and "eval_loss" in got
    assert "eval_rewards/accuracies" not in got  # defined for pairs only


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_precomputed_reference_covers_the_eval_rows(tiny_model_dir, tmp_path: Path, one_thread, method) -> None:
    """precompute_ref_logps: the eval rows' reference comes from the table and gives the same
    eval metrics as the adapter-disabled reference scored at each evaluation."""
    name = "arithmetic_kto" if method == "kto" else "arithmetic_preferences"
    model, data = str(tiny_model_dir("llama")), _subset(tmp_path, name, 16)
    out = {}
    for pre in (False, True):
        logs = Logs()
        cfg = _config(model, tmp_path / f"{method}-{pre}", data, method, max_steps=2, eval_split=0.25, eval_steps=1,
                      preference={"precompute_ref_logps": pre})
        assert run(config_from_dict(cfg), [logs]).status == "completed"
        out[pre] = [r for r in _metrics(tmp_path / f"{method}-{pre}") if "eval_loss" in r]
        if pre:
            assert any("and 4 eval rows" in line for line in logs.lines), logs.lines
    assert [r["step"] for r in out[True]] == [1, 2]
    for x, y in zip(out[False], out[True]):
        for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins", "eval_logps/chosen"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key


def test_early_stopping_and_best_weights_on_eval_loss(tiny_model_dir, tmp_path: Path, one_thread) -> None:
    out = tmp_path / "run"
    cfg = _config(str(tiny_model_dir("llama")), out, _subset(tmp_path, "arithmetic_preferences", 16), max_steps=20,
                  eval_split=0.25, eval_steps=2, early_stopping={"patience": 2, "min_delta": 100.0})
    bests: list[tuple[int, str]] = []

    class Best(Callback):
        def on_best(self, step: int, path: str) -> None:
            bests.append((step, path))

    result = run(config_from_dict(cfg), [Best()])
    assert (result.status, result.step) == ("completed", 6)
    evals = [r for r in _metrics(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6]
    for key in ("eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins", "eval_rewards/accuracies",
                "eval_logps/chosen", "eval_logps/rejected"):
        assert all(key in r for r in evals), key
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["metric"] == "eval_loss" and best["value"] == pytest.approx(min(r["eval_loss"] for r in evals))
    assert (out / "best" / "adapter" / "adapter_config.json").is_file()
    improved = [r["step"] for i, r in enumerate(evals) if all(r["eval_loss"] < e["eval_loss"] for e in evals[:i])]
    assert bests == [(step, str(out / "best")) for step in improved] and bests[-1][0] == best["step"]
