"""GRPO on several devices, on the CPU (2 processes over gloo): two ranks with grad_accum k train
exactly as one process with grad_accum 2k. Each rank samples its share of a step's prompts with
the seeds one process gives them (seeded sampling at temperature 1), so the rollouts, rewards,
group advantages, losses, reduced metrics and final adapter are one process's; a cancel stops
both ranks at one step and the resumed run goes on as the straight one; the held-out prompts are
evaluated a share on each rank."""

from __future__ import annotations

import pytest

from kestrel.config import config_from_dict
from kestrel.training.run import run
from tests.training.test_distributed import CancelAt, _rank_processes, assert_ranks_ended_as_one
from tests.training.test_distributed_eval import _metrics
from tests.training.test_grpo_train import _grpo
from tests.training.test_preference_train import _subset

COMPARED = ("epoch", "loss", "grad_norm", "reward", "reward_std", "reward/format_regex", "reward/length_penalty",
            "frac_reward_zero_std", "kl", "clip_frac", "completion_len_mean", "completion_len_max",
            "completion_stopped_frac")


def test_two_ranks_train_grpo_as_one_process_and_resume_after_a_cancel(tiny_model_dir, tmp_path) -> None:
    """One process with grad_accum 2 against two ranks with grad_accum 1 cancelled at step 2 and
    resumed: 12 prompts, 4 held out and evaluated greedily at steps 2 and 3 (one eval batch: rank 1
    measures it too and drops it), 3 steps of 4 prompts x 4 completions."""
    model = str(tiny_model_dir("llama"))
    data = _subset(tmp_path, "arithmetic_prompts", 12)
    rewards = [{"name": "format_regex", "pattern": "[0-9]"}, {"name": "length_penalty", "target_length": 4, "weight": 0.5}]

    def cfg(out: str, **kw) -> dict:
        return _grpo(model, tmp_path / out, data, max_steps=3, eval_split=0.34, eval_steps=2, grpo=dict(rewards=rewards),
                     **kw)

    one = run(config_from_dict(cfg("one", grad_accum=2)))
    stopped = run(config_from_dict(cfg("two", grad_accum=1, devices=2)), [CancelAt(2)])
    assert one.status == "completed" and stopped.status == "cancelled", (one.error, stopped.error)
    assert stopped.step == 2 and not _rank_processes(tmp_path / "two" / "config.yaml")
    resumed = run(config_from_dict(cfg("two", grad_accum=1, devices=2)))
    assert resumed.status == "completed", resumed.error
    a, b = ([m for m in _metrics(tmp_path / out) if "loss" in m] for out in ("one", "two"))
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        for key in COMPARED:
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (key, x["step"])
    assert len({m["reward"] for m in a}) > 1 and a[0]["frac_reward_zero_std"] < 1  # the rewards carry a signal
    evals = [{m["step"]: m["eval_reward"] for m in _metrics(tmp_path / out) if "eval_reward" in m} for out in ("one", "two")]
    assert sorted(evals[0]) == [2, 3] and evals[1] == pytest.approx(evals[0], rel=1e-5)
    assert_ranks_ended_as_one(tmp_path / "one", tmp_path / "two")
