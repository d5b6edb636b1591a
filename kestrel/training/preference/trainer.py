"""Preference training (DPO, ORPO, SimPO, KTO), read top to bottom: setup, then each step score
-> loss -> update, through the same recipe loop, patched model, kernels and checkpointing as SFT.

    status, last_step = run_preference(config, output_dir, cb)   # config.method in dpo|orpo|kto|simpo

1. setup: seed; load the model patched (NF4 for preference.finetune: qlora); read and tokenize the
   preference rows (prompt masked: only answer tokens are scored); LoRA attached (or every weight
   trainable); reference log-probs precomputed when asked or when training every weight; AdamW,
   schedule, resume as in SFT.
2. reference (DPO, KTO): the micro-batch's rows with the adapter disabled (the base through the
   same fused kernels, adapter products skipped), no gradient (or the precomputed table), before
   the policy's forward, so its activations are gone before the policy keeps its checkpoints.
   KTO also scores each prompt with another row's answer, under the policy and the reference,
   for its KL reference point, also before.
3. score: the same rows (one set of tensors for both passes): a micro-batch of `batch_size` pairs
   runs as one forward of 2 x batch_size rows, the chosen answers first and the rejected after
   them (KTO: batch_size labelled rows); sequence log-probs come from the chunked fused log-prob
   path (`rows.py`). Where the model runs varlen attention each pair is one sample [prompt,
   chosen, rejected] whose prompt is computed once for both answers (preference.share_prompt,
   `share_prompt`). (Scoring is `score.py`'s, shared with evaluation.)
4. update: each micro-batch's loss (a mean over its rows) divided by the step's micro-batch
   count (grad_accum x ranks), so the step's loss is the mean over its micro-batches; then clip
   and step.

On several devices (`kestrel.training.distributed`) each rank takes its share of a step's
micro-batches, as SFT's ranks do: N ranks with grad_accum k train as one device with grad_accum
N k. LoRA's adapter gradients are summed in one all-reduce; a full fine-tune is sharded with
FSDP2 (scoring registered as an FSDP2 forward, `rows.score_through_fsdp`) and its reference
log-probs precomputed, each rank scoring its share. The metrics are reduced over the ranks
(sums and counts in one all-reduce) and rank 0 reports them; an evaluation scores each rank's
share of the eval batches and reduces its sums the same way (`kestrel.training.evaluation`).

Metrics per step, as TRL names them: loss, rewards/chosen, rewards/rejected, rewards/margins,
rewards/accuracies (paired), logps/chosen, logps/rejected, kl (KTO), nll_loss (ORPO, SimPO with
cpo_alpha), log_odds_ratio (ORPO); besides SFT's step, epoch, lr, grad_norm, tokens_per_s
(prompt + answer tokens of every scored row, no padding; a shared prompt counts with each answer,
as TRL counts it), memory, elapsed_s, eta_s; shared_prompt (paired: 1 when prompts were scored
once) and cuda_graphs as the run's performance choices. With an
evaluation set (eval_split / eval_dataset), eval_loss and the same names with an eval_ prefix
every eval_steps and at the end (`evaluation.py`); the best weights kept, early stopping.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kestrel.config import TrainConfig
from kestrel.data.preference_tokens import PreferenceSample
from kestrel.errors import ConfigError
from kestrel.model.loader import load
from kestrel.model.lora import trainable_parameters
from kestrel.model.patching import prompt_sharing_refusal, runs_varlen
from kestrel.recompute.checkpoint import Recompute
from kestrel.training.distributed import World
from kestrel.training.evaluation import Evaluator
from kestrel.training.metrics import Callback
from kestrel.training.grpo.logprobs import check_lm_head
from kestrel.training.preference.data import data_kind, kl_partners, micro_batch, per_epoch, prepare_samples
from kestrel.training.preference.evaluation import eval_rows, preference_evaluator
from kestrel.training.preference.reference import NEEDS_REFERENCE, RefTable, adapter_layers, precompute
from kestrel.training.preference.rows import score_through_fsdp
from kestrel.training.preference.ahead import Ahead, ahead_for
from kestrel.training.preference.score import RowSet, StepStats, micro_loss, stage_metrics
from kestrel.training.recipe import (
    graph_metrics, optimizer_and_resume, optimizer_step, prepare_model, raise_if_diverged, report_step, run_recipe,
    seed_everything,
)


@dataclass
class PreferenceSession:
    """Everything a run holds between setup and the end."""

    config: TrainConfig
    output_dir: Path
    model: nn.Module
    tokenizer: Any
    samples: list[PreferenceSample]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    total_steps: int
    start_step: int
    device: torch.device
    pad_id: int = 0
    flat: bool = False  # padding-free rows (the model runs variable-length attention)
    reference: RefTable | None = None  # precomputed reference log-probs
    partner: list[int] | None = None  # KTO: whose answer each sample's KL row borrows
    recompute: Recompute | None = None
    world: World = field(default_factory=World)  # this rank of a run on several devices
    evaluator: Evaluator | None = None  # with an evaluation set (eval_dataset / eval_split)
    adapter_layers: list[nn.Module] = field(default_factory=list)  # what the reference switch flips (found once)
    share_prompt: bool = False  # paired rows as [prompt, chosen, rejected], the prompt scored once
    ahead: Ahead | None = None  # the next step's reference pass, queued early (`ahead.py`)

    @property
    def paired(self) -> bool:
        return data_kind(self.config.method) == "paired"

    @property
    def train_rows(self) -> RowSet:
        return RowSet(self.samples, self.reference, self.partner)


# --- 1. setup ---------------------------------------------------------------------------------


def share_prompt(config: TrainConfig, model: nn.Module, cb: Callback) -> bool:
    """Whether the run scores each pair's prompt once for both answers (preference.share_prompt),
    said once in the log. ConfigError when `on` cannot be honoured."""
    mode = config.preference.share_prompt
    if data_kind(config.method) != "paired":
        if mode == "on":
            raise ConfigError(f"preference.share_prompt: on shares a prompt between a pair's two answers, and method "
                              f"{config.method} has one answer a row; set it to auto or off")
        return False
    if mode == "off":
        cb.on_log("chosen and rejected scored as separate sequences, each with its prompt (preference.share_prompt: off)")
        return False
    why = prompt_sharing_refusal(model)
    if why is not None and mode == "on":
        raise ConfigError(f"preference.share_prompt: on, but {why}; set it to auto or off")
    if why is not None:
        cb.on_log(f"chosen and rejected scored as separate sequences, each with its prompt: {why} "
                  "(preference.share_prompt: auto)")
        return False
    cb.on_log(f"each pair's prompt scored once for both answers (preference.share_prompt: {mode})")
    return True


def setup(config: TrainConfig, output_dir: Path, cb: Callback, world: World) -> PreferenceSession:
    if config.load_in_4bit and not torch.cuda.is_available():
        raise ConfigError("preference.finetune: qlora loads the base in 4-bit NF4, which needs an NVIDIA GPU with "
                          "CUDA, and none was found; set preference.finetune: lora (or full)")
    seed_everything(config.seed)
    model, tokenizer = load(config.model, config.max_seq_length, load_in_4bit=config.load_in_4bit,
                            dtype=config.dtype, patch=config.fast_kernels)
    device = next(model.parameters()).device
    data = prepare_samples(config, tokenizer, cb)
    samples = data.train
    model, recompute = prepare_model(config, model, output_dir, cb, world)
    if world.distributed and config.trains_all_weights:
        score_through_fsdp(model)
    check_lm_head(model, config.method)
    trainable, total = trainable_parameters(model)
    cb.on_log(f"model {config.model} ({config.method}, {config.preference.finetune}): {trainable:,} of {total:,} "
              f"parameters trainable, on {device}")
    pad, flat = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0), runs_varlen(model)
    window = config.grad_accum * world.size  # micro-batches a step takes, over every rank
    total_steps = config.max_steps or max(
        1, math.ceil((config.epochs or 1.0) * per_epoch(len(samples), config.batch_size) / window))
    train = RowSet(samples, partner=kl_partners(len(samples), config.seed) if config.method == "kto" else None)
    held = RowSet(eval_rows(config, samples, data.held, total_steps, world.size))
    if config.method == "kto" and held.samples:
        held.partner = kl_partners(len(held.samples), config.seed)
    if config.method in NEEDS_REFERENCE and config.lora.init_from and not config.trains_all_weights:
        cb.on_log(f"the reference is the base model {config.model} with the adapter disabled, not the adapter "
                  f"lora.init_from starts from; merge that adapter into a model folder to make it the reference")
    if config.method in NEEDS_REFERENCE and (config.preference.precompute_ref_logps or config.trains_all_weights):
        # Before resume loads trained weights: with no adapter, the weights as loaded are the reference.
        rows = config.batch_size * (2 if data_kind(config.method) == "paired" else 1)
        for part in (train, held) if held.samples else (train,):
            part.reference = precompute(model, part.samples, pad, device, flat, rows, part.partner, world)
        why = "every weight is trained, so there is no adapter to disable" if config.trains_all_weights else "asked"
        cb.on_log(f"reference log-probs precomputed for {len(samples)} rows"
                  + (f" and {len(held.samples)} eval rows" if held.samples else "") + f" ({why})")
    optimizer, scheduler, start = optimizer_and_resume(config, model, total_steps, output_dir, cb)
    s = PreferenceSession(config, output_dir, model, tokenizer, samples, optimizer, scheduler, total_steps, start,
                          device, pad, flat, train.reference, train.partner, recompute, world)
    s.adapter_layers = adapter_layers(model)
    s.share_prompt = share_prompt(config, model, cb)
    s.evaluator = preference_evaluator(s, held, data.held, data.held_rows, cb)
    return s


# --- 4. update and metrics --------------------------------------------------------------------


def train_step(s: PreferenceSession, step: int) -> tuple[StepStats, torch.Tensor, float]:
    """One optimizer step over `grad_accum` micro-batches on each rank; returns its stats, the
    gradient norm (on the device: read with the metrics) and the lr (`stats.loss`: this rank's part
    of the step's loss).

    A step's window is micro-batches step*W .. step*W + W-1 (W = grad_accum x ranks); rank r takes
    every size-th of them from r, as SFT's ranks do."""
    accum, world = s.config.grad_accum, s.world
    stats = StepStats(torch.zeros((), device=s.device))
    for j in range(accum):
        m = (step * accum + j) * world.size + world.rank
        idx = micro_batch(len(s.samples), s.config.batch_size, s.config.seed, m)
        loss = micro_loss(s, s.train_rows, idx, stats) / (accum * world.size)
        (loss * world.loss_scale if world.loss_scale != 1.0 else loss).backward()
        stats.loss += loss.detach()
    # The divergence guard stays on the device: `train_loop` reads the loss and norm with the metrics
    grad_norm, lr = optimizer_step(s, world.sum(stats.loss.clone()), checked_later=True)
    return stats, grad_norm, lr


def train_loop(s: PreferenceSession, cb: Callback) -> str:
    """Steps until done or asked to stop; returns the final status.

    Each step's metrics are staged on their way to the host before the next step's reference pass
    is queued (`ahead.py`), so the host reads and reports them while the GPU scores that pass. A
    step's time runs from the previous step's work being done to its own (the first: from here)."""
    started = done = time.perf_counter()
    s.ahead = ahead_for(s)
    for step in range(s.start_step, s.total_steps):
        stats, grad_norm, lr = train_step(s, step)
        tokens = torch.full((), float(stats.tokens), device=s.device)  # a fill: a host copy would wait for the GPU
        staged = stage_metrics(stats, s.paired, s.world, summed={"tokens": tokens}, shared={"grad_norm": grad_norm})
        if s.ahead is not None and step + 1 < s.total_steps:
            s.ahead.queue(s, step + 1)
        values = staged.read()
        raise_if_diverged(s, step + 1, values["loss"], values["grad_norm"])  # its update was skipped on the device
        t0, done = done, time.perf_counter()
        tokens = int(values.pop("tokens"))
        epoch = (step + 1) * s.config.grad_accum * s.world.size / per_epoch(len(s.samples), s.config.batch_size)
        metrics = {"epoch": epoch, **values, "lr": lr, **graph_metrics(s.recompute),
                   **({"shared_prompt": float(s.share_prompt)} if s.paired else {})}
        stop = report_step(s, cb, step, metrics, tokens, started, t0, done)
        if stop:
            return stop
    return "completed"


def run_preference(config: TrainConfig, output_dir: Path, cb: Callback, world: World | None = None) -> tuple[str, int]:
    """Set up, train and save; returns (status, last step)."""
    return run_recipe(setup, train_loop, config, output_dir, cb, world)
