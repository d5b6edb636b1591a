"""A preference run's evaluation: its held-out rows scored with the method's own objective, in
no_grad, through the shared `Evaluator` (`kestrel.training.evaluation`).

    rows = eval_rows(config, data.train, data.held, total_steps, world.size)  # bounded by the token budget
    evaluator = preference_evaluator(s, RowSet(rows, reference, partner), data.held, data.held_rows, cb)

Metrics, as TRL's trainers name them in evaluation: eval_loss (the method's loss, a mean over the
eval rows: pairs, or KTO's labelled rows; the metric for the best weights and early stopping),
eval_rewards/chosen, eval_rewards/rejected, eval_rewards/margins (chosen - rejected),
eval_rewards/accuracies (paired: share of pairs whose chosen reward is higher), eval_logps/chosen,
eval_logps/rejected, and the method's extras (KTO: eval_kl; ORPO: eval_nll_loss,
eval_log_odds_ratio). The reference is the one training uses: the adapter disabled, or the
precomputed table (precompute_ref_logps, full fine-tuning), precomputed for the eval rows too.

Cost, in the tokens of `kestrel.training.evaluation`'s model: a training step scores
batch_size * grad_accum rows of prompt + answers (chosen and rejected), an evaluation each held-out
row once. Each row runs the same passes in both (the policy forward, the reference forward unless
precomputed, KTO's mismatched KL rows under both), so those factors cancel in the eval share;
training adds the backward on top, so evaluation's share of the wall time is below its share of
tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kestrel.data.preference import PreferenceRow
from kestrel.data.preference_tokens import PreferenceSample
from kestrel.training.evaluation import EvalSums, Evaluator, Measure, cap_eval_tokens, plan_interval
from kestrel.training.generation_check import GENERATION_PROMPTS, GenerationCase, GenerationCheck
from kestrel.training.metrics import METRICS_FILE, Callback, read_series
from kestrel.training.preference.score import RowSet, StepStats, micro_loss

SEQUENCE_STATS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def row_tokens(sample: PreferenceSample) -> int:
    """Tokens one row runs through the policy: its prompt once per answer, and the answers."""
    return sum(len(sample.prompt) + len(a) for a in sample.answers)


def preference_measure(s: Any, data: RowSet, paired: bool) -> Measure:
    """Sums over a micro-batch (indices into `data.samples`): the loss times its rows, each
    per-answer stat with its own count, paired accuracies, batch-level extras times rows."""

    def measure(model: nn.Module, idx: list[int]) -> EvalSums:
        stats = StepStats(torch.zeros((), device=s.device))
        loss = micro_loss(s, data, idx, stats)  # () mean over the rows
        n = float(len(idx))
        sums, counts = {"loss": loss * n}, {}
        for name, parts in zip(SEQUENCE_STATS, (stats.chosen, stats.rejected, stats.logps_chosen,
                                                stats.logps_rejected)):
            values = torch.cat(parts)
            sums[name], counts[name] = values.sum(), float(values.numel())
        if paired:
            sums["rewards/accuracies"] = (stats.chosen[0] > stats.rejected[0]).float().sum()
        for key, values in stats.extra.items():
            sums[key] = torch.cat(values).sum() * n
        return EvalSums(sums, n, stats.tokens, counts)

    return measure


def margins(means: dict[str, float]) -> dict[str, float]:
    """eval_rewards/margins = mean chosen reward - mean rejected reward (for pairs, the mean of
    the per-pair margins; for KTO, TRL's definition over desirable and undesirable rows)."""
    if "eval_rewards/chosen" in means and "eval_rewards/rejected" in means:
        return {"eval_rewards/margins": means["eval_rewards/chosen"] - means["eval_rewards/rejected"]}
    return {}


def generation_cases(rows: list[PreferenceRow], samples: list[PreferenceSample]) -> list[GenerationCase]:
    """Held-out prompts with their preferred answer as the reference (KTO: desirable rows only)."""
    by_line = {r.line: r for r in rows}
    cases = []
    for sample in samples:
        row = by_line.get(sample.line)
        if row is None or row.label is False:
            continue
        user = next((m["content"] for m in reversed(row.prompt) if m["role"] == "user"), "")
        reference = "".join(m["content"] for m in row.chosen if m["role"] == "assistant")
        cases.append(GenerationCase(sample.prompt, user, reference, row.line))
        if len(cases) >= GENERATION_PROMPTS:
            break
    return cases


def steps_tokens(config: Any, train: list[PreferenceSample], ranks: int = 1) -> float:
    """Tokens a training step runs through the policy (batch_size * grad_accum rows on each of
    `ranks` devices; an evaluation's rows are shared among the same devices)."""
    return sum(row_tokens(x) for x in train) / len(train) * config.batch_size * config.grad_accum * ranks


def eval_rows(config: Any, train: list[PreferenceSample], held: list[PreferenceSample],
              total_steps: int, ranks: int = 1) -> list[PreferenceSample]:
    """The held-out rows each evaluation scores: all of them with eval_steps set, else the first
    that fit `cap_eval_tokens` (at least one)."""
    if config.eval_steps is None:
        budget = cap_eval_tokens(total_steps, steps_tokens(config, train, ranks), config.early_stopping.patience)
        used, rows = 0, []
        for x in held:
            if rows and used + row_tokens(x) > budget:
                break
            rows.append(x)
            used += row_tokens(x)
        return rows
    return list(held)


def preference_evaluator(s: Any, data: RowSet, held: list[PreferenceSample], held_rows: list[PreferenceRow],
                         cb: Callback) -> Evaluator | None:
    """The evaluator over `data` (the rows of `eval_rows`, their reference table when training
    precomputes one, KTO's partners; None when there are none): micro-batches of batch_size
    rows, the interval (`plan_interval`), the generation check's prompts from all of `held`,
    early stopping restored from a resumed run's metrics."""
    if not data.samples:
        return None
    config, n = s.config, len(data.samples)
    batches = [list(range(i, min(i + config.batch_size, n))) for i in range(0, n, config.batch_size)]
    plan = plan_interval(s.total_steps, steps_tokens(config, s.samples, s.world.size), sum(row_tokens(x) for x in data.samples),
                         config.eval_steps)
    check = GenerationCheck.sized(generation_cases(held_rows, held), s.tokenizer)
    cb.on_log(f"evaluation: {n} of {len(held)} held-out rows ({plan.eval_tokens:,} tokens) "
              f"{plan.when()}, {plan.share(s.total_steps):.1%} of the training tokens"
              + ("" if n == len(held) or not plan.auto else "; set eval_steps to evaluate every held-out row"))
    return Evaluator(batches, preference_measure(s, data, s.paired), plan, s.output_dir, config.early_stopping,
                     history=read_series(s.output_dir / METRICS_FILE, "eval_loss", s.start_step),
                     generation=check, finish=margins)
