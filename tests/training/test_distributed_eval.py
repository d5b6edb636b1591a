"""Evaluation on several devices, on the CPU (2 processes over gloo): each rank measures its share
of the eval batches (3 batches here, so one rank measures one twice and drops it) and the sums are
reduced, so two ranks report the eval loss one process does, keep the same best weights and stop
early alike. LoRA data parallel, and a full fine-tune sharded with FSDP2 (whose forwards need
every rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel.config import config_from_dict
from kestrel.paths import SAMPLE_DATASETS
from kestrel.training.run import run
from tests.training.test_distributed import _cfg, assert_ranks_ended_as_one
from tests.training.test_preference_eval import Logs


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_ranks_evaluate_as_one_process(method, tiny_model_dir, tmp_path) -> None:
    rows = (SAMPLE_DATASETS / "arithmetic_chat.jsonl").read_text().splitlines()[:25]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(rows) + "\n")  # 5 rows held out: 3 eval batches of 2
    model = tiny_model_dir("llama")
    kw = dict(method=method, dataset=str(data), eval_split=0.2, eval_steps=2, max_steps=4)
    logs = [Logs(), Logs()]
    one = run(config_from_dict(_cfg(model, tmp_path / "one", grad_accum=2, **kw)), [logs[0]])
    two = run(config_from_dict(_cfg(model, tmp_path / "two", grad_accum=1, devices=2, **kw)), [logs[1]])
    assert one.status == two.status == "completed", (one.error, two.error)
    # The plan's share of the training tokens counts both ranks' micro-batches in a step.
    plans = [[line for line in log.lines if line.startswith("evaluation:")] for log in logs]
    assert plans[0] == plans[1] and plans[0]
    evals = [{m["step"]: m["eval_loss"] for m in _metrics(out) if "eval_loss" in m} for out in (tmp_path / "one",
                                                                                                tmp_path / "two")]
    assert list(evals[0]) == list(evals[1]) == [2, 4]
    for step, value in evals[0].items():
        assert evals[1][step] == pytest.approx(value, rel=1e-5)
    marker = [json.loads((out / "best" / "best.json").read_text()) for out in (tmp_path / "one", tmp_path / "two")]
    assert marker[0]["step"] == marker[1]["step"] and marker[1]["value"] == pytest.approx(marker[0]["value"], rel=1e-5)
    assert_ranks_ended_as_one(tmp_path / "one" / "best", tmp_path / "two" / "best")
