"""The evaluation schedule: the token plan's interval until an evaluation has been measured, then
as many evaluations as fit in EVAL_BUDGET of the run's measured training seconds (the final one
included). Seconds here are given, not timed: a simulated run of `total` steps."""

from __future__ import annotations

import random

import pytest

from kestrel.training.evaluation import CHECK_SHARE, EVAL_BUDGET
from kestrel.training.eval_schedule import EvalSchedule


def _simulate(schedule: EvalSchedule, total: int, step_s: list[float], stall_s: list[float],
              start: int = 0) -> tuple[list[int], list[str]]:
    """Run steps start+1..total: each step's seconds from `step_s`, each evaluation's from `stall_s`
    (in turn); returns the evaluated steps and the log lines."""
    evals, logs = [], []
    for done in range(start + 1, total + 1):
        schedule.stepped(step_s[done - 1])
        if schedule.due(done, total):
            line = schedule.evaluated(done, total, stall_s[min(len(evals), len(stall_s) - 1)])
            evals.append(done)
            logs += [line] if line else []
    return evals, logs


def test_cheap_evaluations_keep_the_token_plan() -> None:
    schedule = EvalSchedule(every=10, auto=True, budget=EVAL_BUDGET)
    evals, logs = _simulate(schedule, 60, [0.4] * 60, [0.05])  # 0.05 s each: 7 of them are 0.35 s of 24 s
    assert evals == [10, 20, 30, 40, 50, 60] and logs == []


def test_slow_evaluations_are_spread_out_to_stay_within_the_budget() -> None:
    # The GPU's case (bench/RESULTS.md, session 27): 0.46 s evaluations every 10 steps of 0.39 s.
    schedule = EvalSchedule(every=10, auto=True, budget=EVAL_BUDGET)
    step_s, stall = [0.39] * 600, 0.46
    evals, logs = _simulate(schedule, 600, step_s, [stall])
    assert len(evals) * stall <= EVAL_BUDGET * sum(step_s)
    assert len(evals) >= EVAL_BUDGET * sum(step_s) // stall - 1  # the budget is used, not wasted
    assert evals[0] == 10 and evals[-1] == 600 and all(b - a >= 10 for a, b in zip(evals, evals[1:]))
    assert len(logs) == 1 and "evaluating every 25 steps" in logs[0] and "eval_steps" in logs[0], logs


@pytest.mark.parametrize("seed", range(40))
def test_random_runs_stay_within_the_budget(seed: int) -> None:
    """Runs that no case above describes: step times with slow compile steps and noise, the first
    evaluation slower (warm-up), evaluation costs from negligible to several steps."""
    rng = random.Random(seed)
    total = rng.randint(20, 3000)
    base = rng.uniform(0.01, 5.0)
    step_s = [base * rng.uniform(0.9, 1.1) * (rng.uniform(5, 30) if i < 3 else 1) for i in range(total)]
    cost = base * rng.choice([0.01, 0.1, 0.5, 1, 3, 10])
    stall_s = [cost * rng.uniform(1, 4)] + [cost * rng.uniform(0.9, 1.1) for _ in range(total)]
    every = max(1, total // rng.randint(5, 25))
    evals, _ = _simulate(EvalSchedule(every=every, auto=True, budget=EVAL_BUDGET), total, step_s, stall_s)
    spent = sum(stall_s[: len(evals)])
    first_and_final = stall_s[0] + max(stall_s[1:len(evals)] or [0.0])
    # Within the budget, apart from what no plan can avoid: the first evaluation (before any was
    # measured) and the final one; an evaluation's cost varies by 10% between measurements.
    assert spent <= max(EVAL_BUDGET * sum(step_s) * 1.1, first_and_final) + 1e-9, (seed, evals)
    assert evals[-1] == total and (evals[0] == every or evals == [total])
    assert sorted(set(evals)) == evals
    plan_evals = total // every + (1 if total % every else 0)
    assert len(evals) <= plan_evals  # never more than the token plan


def test_set_eval_steps_is_never_replanned() -> None:
    schedule = EvalSchedule(every=10, auto=False, budget=EVAL_BUDGET)
    evals, logs = _simulate(schedule, 35, [0.1] * 35, [5.0])
    assert evals == [10, 20, 30, 35] and logs == []


def test_a_resumed_run_starts_at_the_next_multiple() -> None:
    evals, _ = _simulate(EvalSchedule(every=10, auto=False, budget=EVAL_BUDGET), 60, [0.1] * 60, [0.0], start=35)
    assert evals == [40, 50, 60]


def test_a_resumed_run_budgets_its_own_steps() -> None:
    """Resumed at step 500 of 600, the run's 100 steps of 1 s allow 5 s of evaluation, not 30 s."""
    schedule = EvalSchedule(every=10, auto=True, budget=EVAL_BUDGET)
    evals, _ = _simulate(schedule, 600, [1.0] * 600, [1.0], start=500)
    assert evals == [510, 533, 556, 578, 600]  # 5 evaluations of 1 s: the 5 s fit exactly


def test_only_the_final_evaluation_when_one_more_does_not_fit_and_patience_is_told() -> None:
    schedule = EvalSchedule(every=5, auto=True, budget=EVAL_BUDGET, patience=3)
    evals, logs = _simulate(schedule, 40, [1.0] * 40, [1.5])  # 2 s of budget, 1.5 s spent at step 5
    assert evals == [5, 40]
    assert "only the final evaluation is left" in logs[0] and "patience 3" in logs[0], logs


# --- the generation check's share ---------------------------------------------------------------


def test_the_generation_checks_reserve_leaves_fewer_periodic_evaluations() -> None:
    """The GPU case again: with the check's reserve taken out of the budget, the same measurements
    fit fewer evaluations, and those stay within what is left."""
    step_s, stall = [0.39] * 600, 0.46
    without, _ = _simulate(EvalSchedule(every=10, auto=True, budget=EVAL_BUDGET), 600, step_s, [stall])
    checked = EvalSchedule(every=10, auto=True, budget=EVAL_BUDGET, check_share=CHECK_SHARE)
    evals, _ = _simulate(checked, 600, step_s, [stall])
    assert len(evals) < len(without)
    assert len(evals) * stall <= (1 - CHECK_SHARE) * EVAL_BUDGET * sum(step_s) + 1e-9 and evals[-1] == 600


@pytest.mark.parametrize("auto", [True, False])
def test_the_final_evaluation_counts_in_the_seconds_spent(auto: bool) -> None:
    stalls = [0.05, 0.025, 0.0125, 0.4]  # cheap enough for the plan to stay every 10; a slow final one
    schedule = EvalSchedule(every=10, auto=auto, budget=EVAL_BUDGET, check_share=CHECK_SHARE)
    evals, _ = _simulate(schedule, 35, [1.0] * 35, stalls)
    assert evals == [10, 20, 30, 35] and schedule.spent_s == pytest.approx(sum(stalls))


def test_the_check_gets_what_the_evaluations_left_and_at_least_its_reserve() -> None:
    """100 steps of 1 s: a budget of 5 s, of which the check's reserve is 2 s."""
    reserve = CHECK_SHARE * EVAL_BUDGET * 100
    assert EvalSchedule(every=10, auto=True, budget=EVAL_BUDGET, check_share=CHECK_SHARE).check_seconds() is None
    cheap = EvalSchedule(every=10, auto=True, budget=EVAL_BUDGET, check_share=CHECK_SHARE)
    evals, _ = _simulate(cheap, 100, [1.0] * 99 + [9.0], [0.1])  # the median step is 1 s
    assert len(evals) == 10 and cheap.check_seconds() == pytest.approx(EVAL_BUDGET * 100 - 10 * 0.1)  # 4 s > 2 s
    slow_final = EvalSchedule(every=10, auto=True, budget=EVAL_BUDGET, check_share=CHECK_SHARE)
    evals, _ = _simulate(slow_final, 100, [1.0] * 100, [0.1] * 9 + [4.0])  # 4.9 s spent: 0.1 s left
    assert len(evals) == 10 and slow_final.check_seconds() == pytest.approx(reserve)


def test_a_run_whose_evaluations_overspent_still_gives_the_check_its_reserve() -> None:
    """eval_steps set by hand: evaluations of 5 s every 10 steps of 0.1 s spend far more than the
    budget, and the check still gets its reserve of the training seconds."""
    schedule = EvalSchedule(every=10, auto=False, budget=EVAL_BUDGET, check_share=CHECK_SHARE)
    _simulate(schedule, 35, [0.1] * 35, [5.0])
    assert schedule.spent_s == pytest.approx(20.0)
    assert schedule.check_seconds() == pytest.approx(CHECK_SHARE * EVAL_BUDGET * 35 * 0.1)


def test_the_check_budgets_the_steps_run_not_those_planned() -> None:
    """Early stopping ends the run at step 40 of 100: the check is held to 40 steps' budget."""
    schedule = EvalSchedule(every=10, auto=True, budget=EVAL_BUDGET, check_share=CHECK_SHARE)
    for done in range(1, 41):
        schedule.stepped(1.0)
        schedule.due(done, 100)
    assert schedule.check_seconds() == pytest.approx(EVAL_BUDGET * 40)


def test_every_rank_plans_from_rank_0s_measurements() -> None:
    """An evaluation is collective: the ranks must agree on its steps, so the numbers come from
    rank 0 (`World.from_main`), not from each rank's own clock."""

    class Rank1:
        def from_main(self, values: list[float]) -> list[float]:
            return [0.39, 0.46]  # what rank 0 measured

    mine, main = EvalSchedule(10, True, EVAL_BUDGET), EvalSchedule(10, True, EVAL_BUDGET)
    for sched, step_s, stall in ((mine, 0.1, 0.01), (main, 0.39, 0.46)):
        for done in range(1, 11):
            sched.stepped(step_s)
            sched.due(done, 600)
    mine.evaluated(10, 600, 0.01, Rank1())  # type: ignore[arg-type]
    main.evaluated(10, 600, 0.46)
    assert mine.next_at == main.next_at == 10 + 25  # 24 more fit in 590 steps


def test_the_training_loop_reports_step_and_evaluation_seconds(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """The recipe feeds the schedule each step's seconds and each evaluation's (forwards and the
    best save), and logs the schedule's line; here every evaluation is made to look expensive."""
    import json

    from kestrel.config import config_from_dict
    from kestrel.training.run import run
    from tests.support.logs import Logs

    seen: list[tuple[int, float, int]] = []
    real = EvalSchedule.evaluated

    def evaluated(self, done, total, stall_s, world=None):  # type: ignore[no-untyped-def]
        seen.append((done, stall_s, len(self.step_s)))
        return real(self, done, total, stall_s + 1000.0 * max(self.step_s), world)

    monkeypatch.setattr(EvalSchedule, "evaluated", evaluated)
    out, logs = tmp_path / "run", Logs()
    cfg = dict(model=str(tiny_model_dir("llama")), dataset="arithmetic_chat", output_dir=str(out), max_seq_length=64,
               batch_size=2, max_steps=30, learning_rate=1e-3, save_steps=0, seed=0, gradient_checkpointing="off",
               eval_split=0.05)
    result = run(config_from_dict(cfg), [logs])
    assert result.status == "completed", result.error
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    first = steps[0]
    assert steps == [first, 30] and first < 30  # the token plan's first, then only the final one fits
    assert [(d, n) for d, _, n in seen] == [(first, first), (30, 30)] and all(s > 0 for _, s, _ in seen)
    assert any("only the final evaluation is left" in line for line in logs.lines), logs.lines
    assert any("further apart if they take over 5% of the training time" in line for line in logs.lines)


def _rank(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: what `World.from_main` gives it for its own numbers."""
    import json
    import os

    import torch.distributed as dist

    from kestrel.training.distributed import World, join

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = World(rank, 2, "cpu")
    join(world)
    try:
        got = world.from_main([0.39 if rank == 0 else 0.1, 0.46 if rank == 0 else 0.01])
        with open(f"{out}.{rank}", "w") as f:
            json.dump(got, f)
    finally:
        dist.destroy_process_group()


def test_from_main_gives_every_rank_rank_0s_numbers(tmp_path) -> None:
    import json

    import torch.multiprocessing as mp

    from kestrel.training.launch import free_port

    mp.spawn(_rank, args=(free_port(), str(tmp_path / "got")), nprocs=2, join=True)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"got.{rank}").read_text()) == pytest.approx([0.39, 0.46])
