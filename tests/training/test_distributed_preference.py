"""Preference methods on several devices, on the CPU (2 processes over gloo): two ranks with
grad_accum k train exactly as one process with grad_accum 2k: the same micro-batches, the loss a
mean over the step's micro-batches of both ranks, the metrics reduced over the ranks; and they
evaluate a held-out split as one process does. LoRA data parallel (reference per step, adapter
disabled) and a full fine-tune sharded with FSDP2 (its reference log-probs precomputed, each rank
scoring its share)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel.config import config_from_dict
from kestrel.training.run import run
from tests.training.test_distributed import CancelAt, _rank_processes, _steps, assert_ranks_ended_as_one
from tests.training.test_distributed_eval import _metrics
from tests.training.test_preference_eval import Logs
from tests.training.test_preference_train import _subset

COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected", "rewards/accuracies", "kl")


def _config(model: Path, data: str, out: Path, method: str, finetune: str, **kw) -> dict:
    base = dict(model=str(model), method=method, dataset=data, output_dir=str(out), max_seq_length=64, batch_size=2,
                max_steps=3, learning_rate=3e-3, save_steps=0, seed=0, gradient_checkpointing="standard",
                dtype="fp32", lr_scheduler="constant", lora={"r": 8, "alpha": 16}, preference={"finetune": finetune})
    return {**base, **kw}


@pytest.mark.parametrize("method, finetune", [("dpo", "lora"), ("dpo", "full"), ("kto", "lora")])
def test_two_ranks_train_as_one_process_with_twice_the_accumulation(method, finetune, tiny_model_dir, tmp_path) -> None:
    model = tiny_model_dir("llama")
    data = _subset(tmp_path, "arithmetic_kto" if method == "kto" else "arithmetic_preferences", 16)
    one = run(config_from_dict(_config(model, data, tmp_path / "one", method, finetune, grad_accum=2)))
    two = run(config_from_dict(_config(model, data, tmp_path / "two", method, finetune, grad_accum=1, devices=2)))
    assert one.status == two.status == "completed", (one.error, two.error)
    a, b = _steps(tmp_path / "one"), _steps(tmp_path / "two")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert y["epoch"] == pytest.approx(x["epoch"])
        for key in COMPARED:
            assert (key in x) == (key in y), key
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (key, x["step"])
    # AdamW's update m / sqrt(v) of a weight whose gradient is near 0 is set by the gradient's last
    # bits, which fp32 summation order changes (3 of 120k elements of the full fine-tune, by < 1e-5).
    assert_ranks_ended_as_one(tmp_path / "one", tmp_path / "two", atol=1e-5)


def test_a_cancelled_two_rank_dpo_run_resumes_as_the_straight_run(tiny_model_dir, tmp_path) -> None:
    """Full fine-tune (FSDP2 shards, precomputed reference): cancel at step 2 checkpoints both
    ranks' shards; the resumed run's steps 3-4 match the straight run's."""
    model = tiny_model_dir("llama")
    data = _subset(tmp_path, "arithmetic_preferences", 16)

    def cfg(out: str) -> dict:
        return _config(model, data, tmp_path / out, "dpo", "full", max_steps=4, devices=2, learning_rate=1e-3)

    straight = run(config_from_dict(cfg("straight")))
    stopped = run(config_from_dict(cfg("resumed")), [CancelAt(2)])
    assert straight.status == "completed" and stopped.status == "cancelled", (straight.error, stopped.error)
    resumed = run(config_from_dict(cfg("resumed")))
    assert resumed.status == "completed", resumed.error
    after = {m["step"]: m["loss"] for m in _steps(tmp_path / "resumed")}
    assert sorted(after) == [1, 2, 3, 4]
    for m in _steps(tmp_path / "straight"):
        assert after[m["step"]] == pytest.approx(m["loss"], rel=1e-5)


EVALUATED = ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins",
             "eval_rewards/accuracies", "eval_logps/chosen", "eval_logps/rejected")


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_two_ranks_evaluate_dpo_as_one_process(finetune, tiny_model_dir, tmp_path) -> None:
    """5 held-out pairs in 3 eval batches of 2 (one rank measures one twice and drops it): the
    eval metrics, the best weights' step and the evaluation plan (rows, tokens, interval, share of
    the training tokens: a step trains both ranks' micro-batches) are one process's. LoRA scores
    the reference with the adapter disabled; the full fine-tune precomputes it for the eval rows,
    each rank its share."""
    model = tiny_model_dir("llama")
    data = _subset(tmp_path, "arithmetic_preferences", 20)
    kw = dict(eval_split=0.25, eval_steps=2)
    logs = {"one": Logs(), "two": Logs()}
    one = run(config_from_dict(_config(model, data, tmp_path / "one", "dpo", finetune, grad_accum=2, **kw)),
              [logs["one"]])
    two = run(config_from_dict(_config(model, data, tmp_path / "two", "dpo", finetune, grad_accum=1, devices=2, **kw)),
              [logs["two"]])
    assert one.status == two.status == "completed", (one.error, two.error)
    evals = [[m for m in _metrics(tmp_path / out) if "eval_loss" in m] for out in ("one", "two")]
    assert [m["step"] for m in evals[0]] == [m["step"] for m in evals[1]] == [2, 3]
    for x, y in zip(*evals):
        for key in EVALUATED:
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (key, x["step"])
    plans = [[line for line in logs[out].lines if line.startswith("evaluation:")] for out in ("one", "two")]
    assert plans[0] == plans[1] and "5 of 5 held-out rows" in plans[0][0]
    marker = [json.loads((tmp_path / out / "best" / "best.json").read_text()) for out in ("one", "two")]
    assert marker[1]["step"] == marker[0]["step"]
    assert not (tmp_path / "two" / "rank-1.log").read_text().count("Traceback")
    assert not _rank_processes(tmp_path / "two" / "config.yaml")
