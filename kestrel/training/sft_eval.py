"""SFT's evaluation: its held-out rows, its `Measure` (token-mean cross-entropy, as training
computes it) and its `Evaluator` (`kestrel.training.evaluation`).

    train_convs, eval_convs = held_out(config, convs, cb)
    evaluator = sft_evaluator(config, tokenizer, eval_convs, plan, total_steps, output_dir, flat, cb)

eval_loss = (sum over every trained token of the eval set of -log p(token)) / (trained tokens):
the same token-weighted mean the training loss is, over eval batches collated as training
batches are (padding or packing, the same width rounding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from kestrel.config import TrainConfig
from kestrel.data import Batch, BatchPlan, Conversation, load_conversations, tokenize_all
from kestrel.data.tokenize import IGNORE, Sample
from kestrel.model.forwards import shift_labels
from kestrel.training.evaluation import EvalSums, Evaluator, cap_eval_tokens, plan_interval, split_for_eval
from kestrel.training.generation_check import GenerationCheck
from kestrel.training.metrics import METRICS_FILE, Callback, read_series


def held_out(config: TrainConfig, convs: list[Conversation], cb: Callback) -> tuple[list[Conversation], list[Conversation]]:
    """(training rows, eval rows): `eval_split` of `convs` held out (seeded, at the row level,
    before tokenizing and packing), or the rows of `eval_dataset`, or none."""
    if config.eval_split > 0:
        return split_for_eval(config, convs, "rows", cb)
    if config.eval_dataset:
        fmt, held, bad = load_conversations(config.eval_dataset, config.dataset_format, config.columns,
                                            config.system_prompt)
        cb.on_log(f"eval_dataset {config.eval_dataset}: format {fmt}, {len(held)} rows, {len(bad)} bad rows skipped")
        return convs, held
    return convs, []


def sft_measure(model: nn.Module, batch: Batch) -> EvalSums:
    """Summed next-token cross-entropy over the batch's trained tokens, and their count.

    (B, T) ids and labels in; the model's own loss with `num_items_in_batch=1` is the sum."""
    b = batch.to(next(model.parameters()).device)
    count = (shift_labels(b.labels) != IGNORE).sum()
    out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                labels=b.labels, num_items_in_batch=1, use_cache=False, **b.model_kwargs())
    return EvalSums({"loss": out.loss}, count, b.tokens)


def _within(samples: list[Sample], budget: int) -> list[Sample]:
    """The first samples whose tokens fit `budget` (at least one)."""
    kept, used = [], 0
    for s in samples:
        if kept and used + len(s.input_ids) > budget:
            break
        kept.append(s)
        used += len(s.input_ids)
    return kept


def sft_evaluator(config: TrainConfig, tokenizer: Any, convs: list[Conversation], plan: BatchPlan, total_steps: int,
                  output_dir: Path, start_step: int, cb: Callback, ranks: int = 1) -> Evaluator | None:
    """The evaluator over `convs` (None when there are none): eval batches collated like `plan`'s,
    the interval (`plan_interval`; a step trains grad_accum micro-batches on each of `ranks`
    devices), the generation check's prompts, early stopping restored from a resumed run's metrics."""
    if not convs:
        return None
    data = tokenize_all(tokenizer, convs, config.max_seq_length, config.train_on_responses_only,
                        config.eval_dataset or config.dataset)
    unit_tokens = [sum(len(s.input_ids) for s in unit) for unit in plan.units]
    per_step = sum(unit_tokens) / max(1, len(unit_tokens)) * config.batch_size * config.grad_accum * ranks
    samples = data.samples
    if config.eval_steps is None:
        samples = _within(samples, cap_eval_tokens(total_steps, per_step, config.early_stopping.patience))
    evals = BatchPlan(samples, config.batch_size, config.packing, config.max_seq_length, plan.pad_id, config.seed,
                      plan.flat)
    batches = evals.in_order()
    ev_plan = plan_interval(total_steps, per_step, sum(b.tokens for b in batches), config.eval_steps)
    history = read_series(output_dir / METRICS_FILE, "eval_loss", start_step)
    check = GenerationCheck.from_conversations(convs, tokenizer, config.max_seq_length)
    cb.on_log(f"evaluation: {len(samples)} of {len(data.samples)} held-out rows ({ev_plan.eval_tokens:,} tokens) "
              f"{ev_plan.when()}, {ev_plan.share(total_steps):.1%} of the training tokens"
              + ("" if len(samples) == len(data.samples) or not ev_plan.auto else
                 "; set eval_steps to evaluate every held-out row"))
    return Evaluator(batches, sft_measure, ev_plan, output_dir, config.early_stopping, history=history,
                     generation=check)
