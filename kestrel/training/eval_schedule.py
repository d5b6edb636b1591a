"""When a run evaluates. Before any step has run, the token plan
(`kestrel.training.evaluation.plan_interval`) sets the interval. When the interval is chosen
automatically (eval_steps unset), each evaluation then re-plans the rest of the run from what the
run itself measured:

- `stall_s`: the seconds the training loop stood still for the evaluation (its forwards, and the
  best weights' save when it is a new best);
- `step_s`: the median seconds of a training step so far (the median, so the steps that compiled
  or met a new shape do not set it).

The rest of the run gets as many evaluations as fit in EVAL_BUDGET of the run's training seconds
(steps * step_s, over the steps this process runs: a resumed run's own), less the reserve of the
end-of-run generation check and the evaluation seconds already spent, the final evaluation
included, each costing the latest `stall_s`; never more than the token plan gives. So with k
evaluations left that fit, the next ones come ceil(steps left / k) steps apart:

    reserve  = check_share * EVAL_BUDGET      (check_share: CHECK_SHARE with a generation check, else 0)
    fits     = floor(((EVAL_BUDGET - reserve) * steps * step_s - spent_s) / stall_s)
    interval = max(token plan's interval, ceil((total_steps - done) / fits))     (fits >= 2)
    interval = total_steps - done  (only the final evaluation)                 (fits <= 1)

The generation check then gets what the evaluations left of the budget, and at least its reserve
(`check_seconds`): the evaluations that ran (the final one included, and all of them with eval_steps
set) are counted in `spent_s`.

    check_seconds = max(reserve * ran * step_s, EVAL_BUDGET * ran * step_s - spent_s)

where `ran` is the number of steps this process ran (fewer than planned when early stopping ends
the run).

Why not tokens alone: an eval token costs one forward against a training token's forward and
backward, yet small eval batches run below the device's speed, a preference method scores each
pair twice, and the best weights' save adds its own seconds. On the GPU a 5% token budget cost
about 12% of the stepping time (bench/RESULTS.md, session 27). The budget is about wall time, so
measured time decides.

On several devices every rank takes rank 0's measurements (one broadcast per evaluation), so all of
them evaluate at the same steps: an evaluation is collective.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from kestrel.training.distributed import World


@dataclass
class EvalSchedule:
    """The steps that evaluate: multiples of `every` (the token plan's interval, or eval_steps)
    until an evaluation re-plans (`evaluated`, automatic intervals only), and the last step."""

    every: int
    auto: bool  # re-plan from measured seconds (eval_steps unset)
    budget: float  # evaluation seconds, at most this share of the run's training seconds
    patience: int = 0  # early stopping's: the log says when fewer evaluations than it needs fit
    check_share: float = 0.0  # of `budget`, kept for the end-of-run generation check (0: the run has none)
    next_at: int | None = None  # the next periodic evaluation's step (None: not started)
    step_s: list[float] = field(default_factory=list)  # seconds of each training step this process ran
    spent_s: float = 0.0  # seconds evaluations held the loop (this process), the final one included
    first: int = 1  # the first step this process ran (a resumed run's budget covers its own steps)
    told: bool = False  # the log has told of a departure from the token plan

    def stepped(self, seconds: float) -> None:
        """A training step took `seconds` (its work done on the device)."""
        self.step_s.append(seconds)

    def due(self, done: int, total_steps: int) -> bool:
        """Whether step `done` (1-based) evaluates; a periodic evaluation moves the next one an
        interval on (`evaluated` may move it further). A resumed run starts at the first multiple
        of `every` after its first step."""
        if self.next_at is None:
            self.next_at = ((done - 1) // self.every + 1) * self.every
            self.first = done
        if done >= self.next_at:
            self.next_at = (done // self.every + 1) * self.every
            return True
        return done == total_steps

    def evaluated(self, done: int, total_steps: int, stall_s: float, world: World | None = None) -> str | None:
        """Re-plan after an evaluation at step `done` that held the loop `stall_s` seconds.
        Returns a line for the log when the plan first departs from the token plan's interval."""
        if not self.auto or not self.step_s or done >= total_steps:
            # Nothing to re-plan, but the seconds count against the generation check's share
            # (`check_seconds`, read on rank 0 alone: no ranks need to agree on it).
            self.spent_s += stall_s
            return None
        step_s, stall_s = (world or World()).from_main([statistics.median(self.step_s), stall_s])
        self.spent_s += stall_s
        left = total_steps - done
        periodic = self.budget - self.check_share * self.budget  # the generation check's reserve is not theirs
        budget_s = periodic * (total_steps - self.first + 1) * step_s  # this process's steps
        fits = math.floor((budget_s - self.spent_s) / max(stall_s, 1e-9))
        interval = left if fits <= 1 else max(self.every, math.ceil(left / fits))
        self.next_at = done + interval
        final = fits <= 1
        if interval == self.every or self.told:
            return None  # the log tells the first departure from the token plan
        self.told = True
        fewer = (f"; early stopping (patience {self.patience}) may not get to act with "
                 f"{max(fits, 1)} evaluations left" if self.patience and fits < self.patience else "")
        return (f"evaluation held training {stall_s:.2f} s ({stall_s / max(step_s, 1e-9):.1f} training steps of "
                f"{step_s:.3f} s): {'only the final evaluation is left' if final else f'evaluating every {interval} steps'} "
                f"(the token plan said every {self.every}), to keep evaluation within {self.budget:.0%} of the "
                f"training time{fewer}; set eval_steps to choose the interval")

    def check_seconds(self) -> float | None:
        """The seconds the end-of-run generation check may take: what the evaluations left of the
        budget, and never less than its reserve (an evaluation slower than planned, or eval_steps
        set by hand, may have spent the rest). Over the steps this process ran (`step_s`), not
        those planned: the check follows the last step run, which is earlier than planned when
        early stopping ends the run. None (no bound) when no step was measured: there is no
        training time to hold it to."""
        if not self.step_s:
            return None
        train_s = len(self.step_s) * statistics.median(self.step_s)
        return max(self.check_share * self.budget * train_s, self.budget * train_s - self.spent_s)
