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
4. update: each micro-batch's loss (a mean over its rows) divided by grad_accum, so the step's
   loss is the mean over its micro-batches; then clip and step.

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
from kestrel.training.metrics import Callback
from kestrel.training.preference import loss as L
from kestrel.training.preference.data import data_kind, kl_partners, micro_batch, per_epoch, prepare_samples
from kestrel.training.preference.reference import NEEDS_REFERENCE, RefTable, as_reference, precompute, sequence_logps
from kestrel.training.grpo.logprobs import check_lm_head
from kestrel.training.preference.rows import answer_logprobs, answer_rows
from kestrel.training.recipe import (
    graph_metrics, optimizer_and_resume, optimizer_step, prepare_model, report_step, run_recipe, seed_everything, step_end,
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
    world: World = field(default_factory=World)  # one device: the config refuses several for now
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
    model, recompute = prepare_model(config, model, output_dir, cb)
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
        reference = precompute(model, samples, pad, device, flat, rows, partner)
        why = "every weight is trained, so there is no adapter to disable" if config.trains_all_weights else "asked"
        cb.on_log(f"reference log-probs precomputed for {len(samples)} rows ({why})")
    total_steps = config.max_steps or max(
        1, math.ceil((config.epochs or 1.0) * per_epoch(len(samples), config.batch_size) / config.grad_accum))
    optimizer, scheduler, start = optimizer_and_resume(config, model, total_steps, output_dir, cb)
    return PreferenceSession(config, output_dir, model, tokenizer, samples, optimizer, scheduler, total_steps, start,
                             device, pad, flat, reference, partner, recompute)


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
    """One optimizer step over `grad_accum` micro-batches; returns its stats and update metrics."""
    accum = s.config.grad_accum
    stats = StepStats(torch.zeros((), device=s.device))
    for j in range(accum):
        idx = micro_batch(len(s.samples), s.config.batch_size, s.config.seed, step * accum + j)
        loss = micro_loss(s, idx, stats) / accum
        loss.backward()
        stats.loss += loss.detach()
    grad_norm, lr = optimizer_step(s, stats.loss)
    return stats, {"grad_norm": float(grad_norm), "lr": lr}


def _mean(parts: list[torch.Tensor]) -> torch.Tensor | None:
    joined = torch.cat(parts) if parts else None
    return joined if joined is not None and joined.numel() else None


def preference_metrics(stats: StepStats, paired: bool) -> dict[str, float]:
    """TRL's metric names (see the module docstring), one host read each."""
    out = {"loss": float(stats.loss)}
    chosen, rejected = _mean(stats.chosen), _mean(stats.rejected)
    if chosen is not None:
        out["rewards/chosen"] = float(chosen.mean())
        out["logps/chosen"] = float(torch.cat(stats.logps_chosen).mean())
    if rejected is not None:
        out["rewards/rejected"] = float(rejected.mean())
        out["logps/rejected"] = float(torch.cat(stats.logps_rejected).mean())
    if paired and chosen is not None and rejected is not None:
        out["rewards/margins"] = float((chosen - rejected).mean())
        out["rewards/accuracies"] = float((chosen > rejected).float().mean())
    elif chosen is not None and rejected is not None:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    out.update({key: float(torch.cat(values).mean()) for key, values in stats.extra.items()})
    return out


def train_loop(s: PreferenceSession, cb: Callback) -> str:
    """Steps until done or asked to stop; returns the final status."""
    started = time.perf_counter()
    for step in range(s.start_step, s.total_steps):
        t0 = time.perf_counter()
        stats, update = train_step(s, step)
        now = step_end(s.device)
        epoch = (step + 1) * s.config.grad_accum / per_epoch(len(s.samples), s.config.batch_size)
        metrics = {"epoch": epoch, **preference_metrics(stats, s.paired), **update, **graph_metrics(s.recompute)}
        stop = report_step(s, cb, step, metrics, stats.tokens, started, t0, now)
        if stop:
            return stop
    return "completed"


def run_preference(config: TrainConfig, output_dir: Path, cb: Callback) -> tuple[str, int]:
    """Set up, train and save; returns (status, last step)."""
    return run_recipe(setup, train_loop, config, output_dir, cb)
