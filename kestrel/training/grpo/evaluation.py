"""GRPO's evaluation: held-out prompts answered greedily, one completion each, through the run's
decode `Generator`, and scored by the run's rewards.

    train, held = held_out_prompts(config, prompts, tokenizer, needs_answers, cb)
    evaluator = grpo_evaluator(config, s, held, cb)     # s: the GrpoSession, without evaluator yet

Metrics (TRL's GRPO eval names): eval_reward (the weighted total, mean over prompts: the metric
for the best weights and early stopping, higher is better) and eval_reward/<name> (each reward's
mean). Cost model as SFT's (`kestrel.training.evaluation`), in tokens: a training step runs
`batch_size * grad_accum * num_generations` rows of prompt + completion, an evaluation one row
per held-out prompt; completions are counted at `max_completion_length` when planning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from kestrel.config import TrainConfig
from kestrel.training.evaluation import EvalSums, Evaluator, Measure, cap_eval_tokens, plan_interval, split_for_eval
from kestrel.training.generation_check import GENERATION_PROMPTS, GenerationCase, GenerationCheck
from kestrel.training.grpo.data import PromptRow, load_prompts
from kestrel.training.grpo.rewards import RewardBatch, RewardSet
from kestrel.training.grpo.rollout import decode_completions
from kestrel.training.metrics import METRICS_FILE, Callback, read_series


def held_out_prompts(config: TrainConfig, prompts: list[PromptRow], tokenizer: Any, needs_answers: bool,
                     cb: Callback) -> tuple[list[PromptRow], list[PromptRow]]:
    """(training prompts, eval prompts): `eval_split` of `prompts` held out (seeded), or the
    prompts of `eval_dataset`, or none."""
    if config.eval_split > 0:
        return split_for_eval(config, prompts, "prompts", cb)
    if config.eval_dataset:
        held, bad, too_long = load_prompts(dataclasses.replace(config, dataset=config.eval_dataset, eval_dataset=None),
                                           tokenizer, needs_answers)
        cb.on_log(f"eval_dataset {config.eval_dataset}: {len(held)} prompts, {len(bad)} bad rows skipped"
                  + (f", {too_long} longer than grpo.max_prompt_length skipped" if too_long else ""))
        return prompts, held
    return prompts, []


def grpo_measure(generator: Any, tokenizer: Any, rewards: RewardSet, max_new_tokens: int) -> Measure:
    """Greedy completions for a batch of prompts, scored: sums of the total and each reward."""

    def measure(model: nn.Module, rows: list[PromptRow]) -> EvalSums:
        out = generator.generate([r.ids for r in rows], max_new_tokens=max_new_tokens,
                                 adapter=getattr(model, "active_adapter", None))
        generator.release()  # the cache never outlives the evaluation (training steps need the memory)
        texts = decode_completions(tokenizer, out.tokens, generator.stop_ids)
        total, parts = rewards(RewardBatch([r.text for r in rows], texts, [r.answer for r in rows],
                                           [len(t) for t in out.tokens]))  # (n,), {key: (n,)}
        device = next(model.parameters()).device  # on several GPUs the sums are all-reduced, and NCCL's tensors live on a GPU
        sums = {"reward": total.sum().to(device), **{f"reward/{key}": v.sum().to(device) for key, v in parts.items()}}
        tokens = sum(len(r.ids) for r in rows) + sum(len(t) for t in out.tokens)
        return EvalSums(sums, float(len(rows)), tokens)

    return measure


def grpo_evaluator(config: TrainConfig, s: Any, held: list[PromptRow], cb: Callback) -> Evaluator | None:
    """The evaluator over `held` (None when empty), with the session's generator and rewards."""
    if not held:
        return None
    g = config.grpo
    row_tokens = lambda r: len(r.ids) + g.max_completion_length  # noqa: E731 - planned, not yet generated
    per_step = (sum(row_tokens(r) for r in s.prompts) / len(s.prompts)) * s.prompts_per_step * g.num_generations
    rows = held
    if config.eval_steps is None:
        budget, used, rows = cap_eval_tokens(s.total_steps, per_step, config.early_stopping.patience), 0, []
        for r in held:
            if rows and used + row_tokens(r) > budget:
                break
            rows.append(r)
            used += row_tokens(r)
    size = config.batch_size * g.num_generations  # rows per decode batch, as the rollouts run them
    batches = [rows[i : i + size] for i in range(0, len(rows), size)]
    plan = plan_interval(s.total_steps, per_step, sum(row_tokens(r) for r in rows), config.eval_steps)
    cases = [GenerationCase(r.ids, r.text, r.answer, r.line) for r in held if r.answer]
    check = GenerationCheck(cases[:GENERATION_PROMPTS], g.max_completion_length, s.generator)
    cb.on_log(f"evaluation: {len(rows)} of {len(held)} held-out prompts {plan.when()}, "
              f"at most {plan.share(s.total_steps):.1%} of the training tokens")
    return Evaluator(batches, grpo_measure(s.generator, s.tokenizer, s.rewards, g.max_completion_length), plan,
                     s.output_dir, config.early_stopping, metric="reward", greater_is_better=True,
                     history=read_series(s.output_dir / METRICS_FILE, "eval_reward", s.start_step), generation=check)
