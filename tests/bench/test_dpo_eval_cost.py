"""bench/dpo.py --eval-split: what evaluation costs a run, read from the steps' metrics."""

from __future__ import annotations

import pytest

from bench.dpo import eval_cost


def test_eval_cost_sums_the_evaluations_over_the_run_wall_time() -> None:
    evals = [{"step": 2, "eval_loss": 0.6, "eval_runtime": 0.05}, {"step": 4, "eval_loss": 0.5, "eval_runtime": 0.15}]
    cost = eval_cost(evals, 4.0, 0.05)
    assert cost["evaluations"] == 2 and cost["eval_s"] == pytest.approx(0.2) and cost["eval_share"] == pytest.approx(0.05)
    assert eval_cost(evals, 4.0, 0.0) == {}  # no evaluation set: nothing reported
