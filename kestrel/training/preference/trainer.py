"""Preference training (DPO, ORPO, SimPO, KTO), read top to bottom: setup, then each step score
-> loss -> update, through the same recipe loop, patched model, kernels and checkpointing as SFT.

    status, last_step = run_preference(config, output_dir, cb)   # config.method in dpo|orpo|kto|simpo

1. setup: seed; load the model patched (NF4 for preference.finetune: qlora); read and tokenize the
   preference rows (prompt masked: only answer tokens are scored); LoRA attached (or every weight
   trainable); reference log-probs precomputed when asked or when training every weight; AdamW,
   schedule, resume as in SFT.
2. score: a micro-batch of `batch_size` pairs runs as one forward of 2 x batch_size rows, the
   chosen answers first and the rejected after them (KTO: batch_size labelled rows); sequence
   log-probs come from the chunked fused log-prob path (`rows.py`).
3. reference (DPO, KTO): the same rows with the adapter disabled, no gradient (or the
   precomputed table). KTO also scores each prompt with another row's answer, under the policy and
   the reference, for its KL reference point.
4. update: each micro-batch's loss (a mean over its rows) divided by the step's micro-batch
   count (grad_accum x ranks), so the step's loss is the mean over its micro-batches; then clip
   and step.

On several devices (`kestrel.training.distributed`) each rank takes its share of a step's
micro-batches, as SFT's ranks do: N ranks with grad_accum k train as one device with grad_accum
N k. LoRA's adapter gradients are summed in one all-reduce; a full fine-tune is sharded with
FSDP2 (scoring registered as an FSDP2 forward, `rows.score_through_fsdp`) and its reference
log-probs precomputed, each rank scoring its share. The metrics are reduced over the ranks
(sums and counts in one all-reduce) and rank 0 reports them.

Metrics per step, as TRL names them: loss, rewards/chosen, rewards/rejected, rewards/margins,
rewards/accuracies (paired), logps/chosen, logps/rejected, kl (KTO), nll_loss (ORPO, SimPO with
cpo_alpha), log_odds_ratio (ORPO); besides SFT's step, epoch, lr, grad_norm, tokens_per_s
(prompt + answer tokens of every scored row, no padding), memory, elapsed_s, eta_s.
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
from kestrel.model.patching import runs_varlen
from kestrel.recompute.checkpoint import Recompute
from kestrel.training.distributed import World
from kestrel.training.evaluation import Evaluator
from kestrel.training.metrics import Callback, memory_metrics
from kestrel.training.preference import loss as L
from kestrel.training.preference.data import data_kind, kl_partners, micro_batch, per_epoch, prepare_samples
from kestrel.training.preference.reference import NEEDS_REFERENCE, RefTable, as_reference, precompute, sequence_logps
from kestrel.training.grpo.logprobs import check_lm_head
from kestrel.training.preference.rows import answer_logprobs, answer_rows, score_through_fsdp
from kestrel.training.recipe import (
    end_of_step, graph_metrics, optimizer_and_resume, optimizer_step, prepare_model, run_recipe, seed_everything,
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
    evaluator: Evaluator | None = None  # no evaluation yet: the config refuses an evaluation set

    @property
    def paired(self) -> bool:
        return data_kind(self.config.method) == "paired"


@dataclass
class StepStats:
    """Detached per-row values of a step's micro-batches, reduced once for the metrics."""

    loss: torch.Tensor
    chosen: list[torch.Tensor] = field(default_factory=list)  # rewards; KTO: of desirable rows
    rejected: list[torch.Tensor] = field(default_factory=list)
    logps_chosen: list[torch.Tensor] = field(default_factory=list)
    logps_rejected: list[torch.Tensor] = field(default_factory=list)
    extra: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    tokens: int = 0


# --- 1. setup ---------------------------------------------------------------------------------


def setup(config: TrainConfig, output_dir: Path, cb: Callback, world: World) -> PreferenceSession:
    if config.load_in_4bit and not torch.cuda.is_available():
        raise ConfigError("preference.finetune: qlora loads the base in 4-bit NF4, which needs an NVIDIA GPU with "
                          "CUDA, and none was found; set preference.finetune: lora (or full)")
    seed_everything(config.seed)
    model, tokenizer = load(config.model, config.max_seq_length, load_in_4bit=config.load_in_4bit,
                            dtype=config.dtype, patch=config.fast_kernels)
    device = next(model.parameters()).device
    samples = prepare_samples(config, tokenizer, cb)
    model, recompute = prepare_model(config, model, output_dir, cb, world)
    if world.distributed and config.trains_all_weights:
        score_through_fsdp(model)
    check_lm_head(model, config.method)
    trainable, total = trainable_parameters(model)
    cb.on_log(f"model {config.model} ({config.method}, {config.preference.finetune}): {trainable:,} of {total:,} "
              f"parameters trainable, on {device}")
    pad, flat = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0), runs_varlen(model)
    partner = kl_partners(len(samples), config.seed) if config.method == "kto" else None
    reference = None
    if config.method in NEEDS_REFERENCE and config.lora.init_from and not config.trains_all_weights:
        cb.on_log(f"the reference is the base model {config.model} with the adapter disabled, not the adapter "
                  f"lora.init_from starts from; merge that adapter into a model folder to make it the reference")
    if config.method in NEEDS_REFERENCE and (config.preference.precompute_ref_logps or config.trains_all_weights):
        # Before resume loads trained weights: with no adapter, the weights as loaded are the reference.
        rows = config.batch_size * (2 if data_kind(config.method) == "paired" else 1)
        reference = precompute(model, samples, pad, device, flat, rows, partner, world)
        why = "every weight is trained, so there is no adapter to disable" if config.trains_all_weights else "asked"
        cb.on_log(f"reference log-probs precomputed for {len(samples)} rows ({why})")
    window = config.grad_accum * world.size  # micro-batches a step takes, over every rank
    total_steps = config.max_steps or max(
        1, math.ceil((config.epochs or 1.0) * per_epoch(len(samples), config.batch_size) / window))
    optimizer, scheduler, start = optimizer_and_resume(config, model, total_steps, output_dir, cb)
    return PreferenceSession(config, output_dir, model, tokenizer, samples, optimizer, scheduler, total_steps, start,
                             device, pad, flat, reference, partner, recompute, world)


# --- 2-3. score and reference -----------------------------------------------------------------


def _reference(s: PreferenceSession, idx: list[int], pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """(R,) reference log-probs of the micro-batch's rows, in `pairs` order (answer-major)."""
    if s.reference is not None:
        return s.reference.answers[idx].t().reshape(-1)  # (A, P) -> answer-major, as the rows are
    with as_reference(s.model):
        return sequence_logps(s.model, pairs, s.pad_id, s.device, s.flat)


def _kto_kl(s: PreferenceSession, idx: list[int]) -> torch.Tensor:
    """KTO's KL estimate over the micro-batch's mismatched rows (no gradient)."""
    assert s.partner is not None
    rows = [(s.samples[i].prompt, s.samples[s.partner[i]].answers[0]) for i in idx]
    with torch.no_grad():
        policy = sequence_logps(s.model, rows, s.pad_id, s.device, s.flat)
    if s.reference is not None and s.reference.kl is not None:
        ref = s.reference.kl[idx]
    else:
        with as_reference(s.model):
            ref = sequence_logps(s.model, rows, s.pad_id, s.device, s.flat)
    return L.kto_kl(policy, ref)


def micro_loss(s: PreferenceSession, idx: list[int], stats: StepStats) -> torch.Tensor:
    """The loss of one micro-batch (a mean over its rows), its stats added to `stats`."""
    p, method = s.config.preference, s.config.method
    chosen = [s.samples[i] for i in idx]
    pairs = [(x.prompt, x.answers[k]) for k in range(len(chosen[0].answers)) for x in chosen]  # answer-major
    rows = answer_rows(pairs, s.pad_id, s.device, s.flat)
    logp = answer_logprobs(s.model, rows)  # (R, L)
    seq, tokens = logp.sum(-1), rows.tokens.to(logp.dtype)  # (R,)
    stats.tokens += rows.real_tokens
    if method == "kto":
        labels = torch.tensor([bool(x.label) for x in chosen], device=s.device)
        out = L.kto_loss(seq, _reference(s, idx, pairs), labels, _kto_kl(s, idx), p.beta,
                         p.desirable_weight, p.undesirable_weight)
        stats.chosen.append(out.rewards[labels])
        stats.rejected.append(out.rewards[~labels])
        stats.logps_chosen.append(seq.detach()[labels])
        stats.logps_rejected.append(seq.detach()[~labels])
        stats.extra.setdefault("kl", []).append(out.kl.reshape(1))
        return out.loss
    n = len(idx)
    if method == "dpo":
        ref = _reference(s, idx, pairs)
        out = L.dpo_loss(seq[:n], seq[n:], ref[:n], ref[n:], p.beta, p.loss_type, tokens[:n], tokens[n:])
    else:
        mean = seq / tokens.clamp(min=1)  # per-token mean log-probs (ORPO, SimPO)
        nll = -seq[:n].sum() / tokens[:n].sum().clamp(min=1)  # the chosen answers' mean token NLL
        out = (L.orpo_loss(mean[:n], mean[n:], nll, p.beta) if method == "orpo"
               else L.simpo_loss(mean[:n], mean[n:], nll, p.beta, p.simpo_gamma, p.cpo_alpha))
    stats.chosen.append(out.chosen_rewards)
    stats.rejected.append(out.rejected_rewards)
    stats.logps_chosen.append(seq.detach()[:n])
    stats.logps_rejected.append(seq.detach()[n:])
    for key, value in out.extra.items():
        stats.extra.setdefault(key, []).append(value.reshape(1))
    return out.loss


# --- 4. update and metrics --------------------------------------------------------------------


def train_step(s: PreferenceSession, step: int) -> tuple[StepStats, dict[str, float]]:
    """One optimizer step over `grad_accum` micro-batches on each rank; returns its stats and
    update metrics (`stats.loss`: this rank's part of the step's loss).

    A step's window is micro-batches step*W .. step*W + W-1 (W = grad_accum x ranks); rank r takes
    every size-th of them from r, as SFT's ranks do."""
    accum, world = s.config.grad_accum, s.world
    stats = StepStats(torch.zeros((), device=s.device))
    for j in range(accum):
        m = (step * accum + j) * world.size + world.rank
        idx = micro_batch(len(s.samples), s.config.batch_size, s.config.seed, m)
        loss = micro_loss(s, idx, stats) / (accum * world.size)
        (loss * world.loss_scale if world.loss_scale != 1.0 else loss).backward()
        stats.loss += loss.detach()
    grad_norm, lr = optimizer_step(s, world.sum(stats.loss.clone()))
    return stats, {"grad_norm": float(grad_norm), "lr": lr}


def _joined(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat(parts).double() if parts else torch.zeros(0, dtype=torch.float64, device=device)


def preference_metrics(stats: StepStats, paired: bool, world: World | None = None) -> dict[str, float]:
    """TRL's metric names (see the module docstring): each a mean over the step's rows (pairs;
    KTO: its desirable or undesirable rows; the extras: micro-batches) of every rank, from one
    all-reduce of (sum, count) per metric and the loss. A metric with no row is left out."""
    world = world or World()
    device = stats.loss.device
    chosen, rejected = _joined(stats.chosen, device), _joined(stats.rejected, device)
    parts = {"rewards/chosen": chosen, "rewards/rejected": rejected,
             "logps/chosen": _joined(stats.logps_chosen, device), "logps/rejected": _joined(stats.logps_rejected, device),
             **{key: _joined(values, device) for key, values in stats.extra.items()}}
    if paired:  # chosen and rejected answers of the same pairs
        parts["rewards/margins"] = chosen - rejected
        parts["rewards/accuracies"] = (chosen > rejected).double()
    names = list(parts)  # the same on every rank: the method decides them
    sums = torch.stack([stats.loss.double().reshape(()), *(v for n in names for v in (parts[n].sum(),
                        torch.tensor(float(parts[n].numel()), dtype=torch.float64, device=device)))])
    values = world.sum(sums).tolist()
    out = {"loss": values[0]}
    for i, name in enumerate(names):
        total, count = values[1 + 2 * i], values[2 + 2 * i]
        if count:
            out[name] = total / count
    if not paired and "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def train_loop(s: PreferenceSession, cb: Callback) -> str:
    """Steps until done or asked to stop; returns the final status."""
    started = time.perf_counter()
    for step in range(s.start_step, s.total_steps):
        t0 = time.perf_counter()
        stats, update = train_step(s, step)
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        now, done = time.perf_counter(), step + 1
        elapsed = now - started
        tokens = stats.tokens
        if s.world.distributed:
            tokens = int(s.world.sum(torch.tensor([float(tokens)], device=s.device)).item())
        metrics = {
            "step": done, "total_steps": s.total_steps,
            "epoch": done * s.config.grad_accum * s.world.size / per_epoch(len(s.samples), s.config.batch_size),
            **preference_metrics(stats, s.paired, s.world), **update, "tokens_per_s": tokens / max(now - t0, 1e-9),
            **memory_metrics(s.device), **s.world.per_device(memory_metrics(s.device)),
            "elapsed_s": elapsed, **graph_metrics(s.recompute),
            "eta_s": elapsed / (done - s.start_step) * (s.total_steps - done),
        }
        stop = end_of_step(s, cb, done, metrics)
        if stop:
            return stop
    return "completed"


def run_preference(config: TrainConfig, output_dir: Path, cb: Callback, world: World | None = None) -> tuple[str, int]:
    """Set up, train and save; returns (status, last step)."""
    return run_recipe(setup, train_loop, config, output_dir, cb, world)
