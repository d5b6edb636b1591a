"""Evaluation during training: the held-out metrics every `eval_steps` and at the end, the best
weights kept, early stopping. Method-agnostic: a recipe supplies its eval batches and a `Measure`
(what one batch contributes: metric sums and the weight they are summed over), so SFT scores
token-mean loss, GRPO the rewards of greedy answers, and a preference method its per-pair loss
and rewards through the same loop: a new recipe builds `Evaluator(its batches, its measure, ...)`
in its setup and sets it as its run state's `evaluator`; `kestrel.training.recipe` does the rest.

    ev = Evaluator(batches, measure, EvalPlan(every=50, ...), output_dir, config.early_stopping)
    ev.due(done, total)        -> bool
    ev.evaluate(model)         -> {"eval_loss": ..., "eval_runtime": ...}   (TRL's names)
    ev.record(step, metrics, model, tokenizer) -> "stop" when early stopping says so

The default interval starts from a cost model in tokens (`plan_interval`): evaluation is held to
EVAL_BUDGET (5%) of the run's training tokens, at most MAX_EVALS evaluations. The eval set itself
is bounded first (`cap_eval_tokens`) so that at least MIN_EVALS (and patience + 2) evaluations fit
in that budget. An eval token looked cheaper than a training token (one forward against a forward
and a backward), yet on the GPU the 5% token budget cost about 12% of the stepping time, so from
the first evaluation on the measured seconds re-plan the interval (`EvalSchedule`): evaluation
stays within EVAL_BUDGET of the run's training time. The end-of-run generation check is held to the
same budget: CHECK_SHARE of it is reserved for the check, which stops decoding once its seconds are
spent (`GenerationCheck.run`).

The best weights (lowest eval loss so far; GRPO: highest eval reward) go to `output_dir/best/`
(adapter/ or model/, with the tokenizer), marked by `best/best.json` (`kestrel.training.best`);
the export picks them by default.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from kestrel.config_evaluation import EarlyStoppingSettings
from kestrel.data.split import split_rows
from kestrel.training.best import BEST_DIR
from kestrel.training.best_writes import BestWrites
from kestrel.training.distributed import World, reshard_after_scoring
from kestrel.training.eval_schedule import EvalSchedule

if TYPE_CHECKING:
    from kestrel.config import TrainConfig
    from kestrel.training.generation_check import GenerationCheck
    from kestrel.training.metrics import Callback

EVAL_BUDGET = 0.05  # evaluation tokens, at most this share of the run's training tokens
# Of EVAL_BUDGET, the share reserved for the end-of-run generation check when the run has one; the
# periodic evaluations (the final one included) get the rest. A policy, not a measured threshold:
# the check is a fixed cost that would otherwise break the budget on a short run, and its answers
# are worth reading cut short rather than not at all (`EvalSchedule.check_seconds`).
CHECK_SHARE = 0.4
MAX_EVALS = 25  # automatic interval: at most this many evaluations a run (each may save the best)
MIN_EVALS = 5  # automatic interval: the eval set is bounded so that at least this many fit



def split_for_eval(config: TrainConfig, items: list, noun: str, cb: Callback) -> tuple[list, list]:
    """(trained, held out): `config.eval_split` of `items` held out by `split_rows` (seeded, in
    the file's order), logged the same way for every method; `noun` names the items."""
    train, held = split_rows(items, config.eval_split, config.seed, config.dataset)
    cb.on_log(f"eval_split {config.eval_split:g}: {len(held)} of {len(items)} {noun} held out for evaluation "
              f"(seed {config.seed}), {len(train)} trained on")
    return train, held

@dataclass
class EvalSums:
    """One eval batch's contribution: `sums[name]` is the sum of a metric over `weight` items
    (trained tokens for SFT, pairs for a preference method); the eval value is sum / weight."""

    sums: dict[str, torch.Tensor]  # name (without the eval_ prefix) -> () tensor
    weight: torch.Tensor | float
    tokens: int  # tokens run through the model (what the cost model counts)
    # A metric's own weight where it is a mean over other items (KTO's rewards/chosen: over the
    # desirable rows only); a metric whose weight sums to 0 over the eval set is left out.
    counts: dict[str, torch.Tensor | float] = field(default_factory=dict)


Measure = Callable[[nn.Module, Any], EvalSums]


@dataclass
class EvalPlan:
    """How often to evaluate and what it costs, in tokens."""

    every: int  # evaluate when the step count is a multiple of this, and at the last step
    eval_tokens: int  # tokens of one evaluation
    train_tokens_per_step: float
    auto: bool  # `every` chosen by plan_interval (eval_steps unset)

    def when(self) -> str:
        """For the run's log: `every N steps and at the end`, saying the interval may grow."""
        grows = f" (further apart if they take over {EVAL_BUDGET:.0%} of the training time)" if self.auto else ""
        return f"every {self.every} steps{grows} and at the end"

    def evaluations(self, total_steps: int) -> int:
        """How many evaluations a run of `total_steps` runs (the last step always evaluates)."""
        return total_steps // self.every + (1 if total_steps % self.every else 0)

    def share(self, total_steps: int) -> float:
        """Eval tokens / training tokens over the whole run."""
        return self.evaluations(total_steps) * self.eval_tokens / max(1.0, total_steps * self.train_tokens_per_step)


def cap_eval_tokens(total_steps: int, train_tokens_per_step: float, patience: int = 0) -> int:
    """The most tokens the automatic plan evaluates at a time: the run's eval budget shared by
    max(MIN_EVALS, patience + 2) evaluations, enough points for the chart and for early stopping
    to act (a smaller eval set is noisier; eval_steps set by hand lifts the bound)."""
    return int(EVAL_BUDGET * total_steps * train_tokens_per_step / max(MIN_EVALS, patience + 2))


def plan_interval(total_steps: int, train_tokens_per_step: float, eval_tokens: int, eval_steps: int | None) -> EvalPlan:
    """The interval: `eval_steps` as given, else the shortest whose evaluations (the final one
    included) stay within EVAL_BUDGET of the training tokens and number at most MAX_EVALS."""
    if eval_steps is not None:
        return EvalPlan(eval_steps, eval_tokens, train_tokens_per_step, auto=False)
    budget = EVAL_BUDGET * total_steps * train_tokens_per_step
    evals = max(1, min(MAX_EVALS, int(budget // max(1, eval_tokens))))
    # ceil(total / evals) steps apart gives ceil(total / every) <= evals evaluations.
    return EvalPlan(max(1, math.ceil(total_steps / evals)), eval_tokens, train_tokens_per_step, auto=True)


@dataclass
class EarlyStopState:
    """The best value so far and how many evaluations in a row have not improved on it by more
    than `min_delta` (lower is better)."""

    best: float | None = None
    best_step: int = 0
    stale: int = 0

    def update(self, step: int, value: float, min_delta: float) -> bool:
        """Take an evaluation; returns whether it is a new best (any strict improvement)."""
        if self.best is None or value < self.best:
            if self.best is None or self.best - value > min_delta:
                self.stale = 0
            else:
                self.stale += 1
            self.best, self.best_step = value, step
            return True
        self.stale += 1
        return False


def replay(history: list[tuple[int, float]], min_delta: float) -> EarlyStopState:
    """The state after the evaluations of `history` (step, value), e.g. on resume."""
    state = EarlyStopState()
    for step, value in history:
        state.update(step, value, min_delta)
    return state


class Evaluator:
    """Runs a recipe's eval batches through its `measure` and keeps the run's best weights:
    those with the lowest eval_<metric> (the highest with `greater_is_better`, e.g. GRPO's
    reward). `history` ((step, eval value) of earlier evaluations: a resumed run's) restores
    early stopping; `generation` holds the prompts of the end-of-run generation check; `finish`
    adds metrics derived from the means (a preference method's eval_rewards/margins)."""

    def __init__(self, batches: list[Any], measure: Measure, plan: EvalPlan, output_dir: Path,
                 early_stopping: EarlyStoppingSettings, metric: str = "loss", greater_is_better: bool = False,
                 history: list[tuple[int, float]] | None = None, generation: GenerationCheck | None = None,
                 finish: Callable[[dict[str, float]], dict[str, float]] | None = None) -> None:
        self.batches, self.measure, self.plan, self.generation = batches, measure, plan, generation
        self.finish = finish
        self.output_dir, self.early_stopping, self.metric = Path(output_dir), early_stopping, metric
        self.sign = -1.0 if greater_is_better else 1.0  # the state compares sign * value, lower is better
        self.state = replay([(step, self.sign * v) for step, v in history or []], early_stopping.min_delta)
        self.tokens_evaluated = 0  # over this process's evaluations (the cost test counts them)
        self.best_writes = BestWrites(self.output_dir)  # the recipe reports and waits for its writes
        check_share = CHECK_SHARE if generation is not None and generation.cases else 0.0
        self.schedule = EvalSchedule(plan.every, plan.auto, EVAL_BUDGET, early_stopping.patience, check_share)

    def due(self, done: int, total_steps: int) -> bool:
        return self.schedule.due(done, total_steps)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, world: World | None = None) -> dict[str, float]:
        """Every eval batch through `measure` in eval mode without gradients; returns
        eval_<name> = sum over batches / total weight (the metric's own count where it has one;
        one host read), the `finish` metrics derived from those means, and eval_runtime (s).

        On several devices (`world`) rank r measures batches r, r + N, ... and one all-reduce
        sums the sums and counts, so every rank gets the value one device would (each batch is
        measured once: cheaper than rank 0 measuring all of them while the others wait, and a
        forward of an FSDP2-sharded model needs every rank anyway). Every rank runs the same
        number of forwards: one past the last batch measures a batch again and drops it. So
        `measure` returns the same metric names on every batch (a count of 0 where it has none)."""
        world = world or World()
        t0, was_training = time.perf_counter(), model.training
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        weights: dict[str, torch.Tensor | float] = {}
        mine = range(world.rank, math.ceil(len(self.batches) / world.size) * world.size, world.size)
        try:
            for k in mine:
                part = self.measure(model, self.batches[min(k, len(self.batches) - 1)])
                keep = k < len(self.batches)
                for name, value in part.sums.items():
                    value = value.detach().float() if keep else torch.zeros_like(value.detach().float())
                    totals[name] = totals[name] + value if name in totals else value
                    weights[name] = weights.get(name, 0.0) + (part.counts.get(name, part.weight) if keep else 0.0)
                self.tokens_evaluated += part.tokens if keep else 0
        finally:
            model.train(was_training)
        reshard_after_scoring(model)
        names = sorted(totals)
        out: dict[str, float] = {}
        if names:  # every rank has the same names (each measures at least one batch, `Measure`)
            sums = torch.stack([totals[n].reshape(()) for n in names])
            counts = torch.stack([torch.as_tensor(weights[n], dtype=torch.float32, device=sums.device).reshape(())
                                  for n in names])
            both = world.sum(torch.stack([sums, counts]))  # (2, names): one all-reduce
            pairs = torch.stack([both[0] / both[1].clamp(min=1e-12), both[1]]).tolist()  # one host read
            out = {f"eval_{n}": v for n, v, w in zip(names, *pairs) if w > 0}
        if self.finish is not None:
            out.update(self.finish(out))
        out["eval_runtime"] = time.perf_counter() - t0
        return out

    def record(self, step: int, metrics: dict[str, float], model: nn.Module, tokenizer: Any,
               log: Callable[[str], None], world: World | None = None) -> bool:
        """Take an evaluation's metrics: save the weights when they are the best so far; returns
        True when early stopping ends the run here. On several devices (`world`) every rank
        calls it with the same (reduced) metrics, so all of them decide alike; rank 0 writes."""
        value = metrics[f"eval_{self.metric}"]
        if not math.isfinite(value):
            log(f"eval_{self.metric} at step {step} is {value}: not compared for the best weights")
            return False
        if self.state.update(step, self.sign * value, self.early_stopping.min_delta):
            self.save_best(step, value, model, tokenizer, world)
            log(f"step {step}: best eval_{self.metric} so far ({value:.4f}); weights kept in {self.output_dir / BEST_DIR}")
        patience = self.early_stopping.patience
        if patience and self.state.stale >= patience:
            log(f"early stopping at step {step}: eval_{self.metric} has not improved by more than "
                f"{self.early_stopping.min_delta:g} for {patience} evaluations; the best was "
                f"{self.sign * (self.state.best or 0.0):.4f} at step {self.state.best_step} "
                f"(kept in {self.output_dir / BEST_DIR})")
            return True
        return False

    def save_best(self, step: int, value: float, model: nn.Module, tokenizer: Any, world: World | None = None) -> None:
        """The weights into best/ and then the marker (`BestWrites`: an adapter in the
        background, once copied to host memory). On several devices every rank calls it."""
        self.best_writes.save(step, f"eval_{self.metric}", value, model, tokenizer, world)
