"""Supervised fine-tuning, read top to bottom: setup, train, save.

    result = run_sft(config, callbacks)

1. setup: seed, load the model (NF4 for QLoRA) patched, read + tokenize the dataset, plan batches,
   attach LoRA (or unfreeze everything), checkpointing, optimizer, schedule, resume.
2. train: each step accumulates `grad_accum` micro-batches; the loss is a sum over trained tokens
   divided by the window's token count (so accumulation equals one big batch), then clip, step.
3. save: checkpoints every `save_steps`; at the end `adapter/` (or `model/`) and `config.yaml`.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from engine.checkpoints import latest_checkpoint, load_checkpoint, save_checkpoint, save_weights
from engine.checkpointing import Recompute, set_gradient_checkpointing
from engine.config import TrainConfig
from engine.data import BatchPlan, load_conversations, tokenize_all
from engine.data.tokenize import IGNORE
from engine.fast_forwards import shift_labels
from engine.graph_choice import Decision
from engine.loader import load
from engine.patching import runs_varlen
from engine.lora import attach_lora, trainable_parameters
from engine.metrics import Callback, RunInfo, memory_metrics


@dataclass
class Session:
    """Everything a run holds between setup and the end."""

    config: TrainConfig
    output_dir: Path
    model: nn.Module
    tokenizer: Any
    plan: BatchPlan
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    total_steps: int
    start_step: int
    device: torch.device
    recompute: Recompute | None = None  # checkpointing and its CUDA-graph choice


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def lr_lambda(config: TrainConfig, total_steps: int):
    """Linear warmup, then cosine / linear decay to zero, or constant."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / (config.warmup_steps + 1)
        if config.lr_scheduler == "constant":
            return 1.0
        progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        progress = min(1.0, progress)
        return 0.5 * (1 + math.cos(math.pi * progress)) if config.lr_scheduler == "cosine" else 1.0 - progress

    return factor


def prepare_data(config: TrainConfig, tokenizer: Any, cb: Callback, flat: bool = False) -> BatchPlan:
    """The dataset read, tokenized and planned into batches (`flat`: `BatchPlan`'s)."""
    fmt, convs, bad = load_conversations(config.dataset, config.dataset_format, config.columns, config.system_prompt)
    data = tokenize_all(tokenizer, convs, config.max_seq_length, config.train_on_responses_only, config.dataset)
    cb.on_log(f"dataset {config.dataset}: format {fmt}, {len(convs)} rows used, {len(bad)} bad rows skipped")
    if bad:
        cb.on_log("bad rows: " + "; ".join(f"line {b.line}: {b.reason}" for b in bad[:5]))
    if data.truncated:
        cb.on_log(f"{data.truncated} rows were longer than max_seq_length={config.max_seq_length} and were truncated")
    if data.fully_masked:
        cb.on_log(f"{data.fully_masked} rows had no trained tokens left and were dropped")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return BatchPlan(data.samples, config.batch_size, config.packing, config.max_seq_length, pad, config.seed, flat)


def graph_reporter(output_dir: Path, cb: Callback) -> Callable[[Decision], None]:
    """Where a run's CUDA-graph choices go: a line in its log each, and all of them in
    `output_dir/performance.json` (with the mode that reproduces each)."""
    made: list[dict[str, Any]] = []

    def report(decision: Decision) -> None:
        way = "on" if decision.graphed else "off"
        cb.on_log(f"CUDA graphs {way} for batches of {decision.layout}: {decision.reason}")
        made.append(decision.as_metrics())
        (output_dir / "performance.json").write_text(json.dumps({"cuda_graphs": made}, indent=1) + "\n")

    return report


def prepare_model(
    config: TrainConfig, model: nn.Module, output_dir: Path, cb: Callback
) -> tuple[nn.Module, Recompute | None]:
    """LoRA attached (or every weight unfrozen), checkpointing on, train mode; returns the model
    and the run's checkpointing (None when off)."""
    if config.method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        model = attach_lora(model, config.lora)
    perf = config.performance
    recompute = set_gradient_checkpointing(
        model, config.gradient_checkpointing, perf.cuda_graphs, graph_reporter(output_dir, cb), perf.offload_gate)
    model.train()
    return model, recompute


def setup(config: TrainConfig, output_dir: Path, cb: Callback) -> Session:
    seed_everything(config.seed)
    model, tokenizer = load(
        config.model, config.max_seq_length, load_in_4bit=config.load_in_4bit, dtype=config.dtype, patch=config.fast_kernels
    )
    device = next(model.parameters()).device
    plan = prepare_data(config, tokenizer, cb, flat=runs_varlen(model))
    model, recompute = prepare_model(config, model, output_dir, cb)
    trainable, total = trainable_parameters(model)
    cb.on_log(f"model {config.model} ({config.method}): {trainable:,} of {total:,} parameters trainable, on {device}")
    total_steps = config.max_steps or max(1, math.ceil((config.epochs or 1.0) * len(plan) / config.grad_accum))
    optimizer, scheduler, start = optimizer_and_resume(config, model, total_steps, output_dir, cb)
    return Session(config, output_dir, model, tokenizer, plan, optimizer, scheduler, total_steps, start, device,
                   recompute)


def optimizer_and_resume(
    config: TrainConfig, model: nn.Module, total_steps: int, output_dir: Path, cb: Callback
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, int]:
    """AdamW over the trainable parameters and the lr schedule, restored (with the model) from the
    latest checkpoint in `output_dir` when there is one. Returns them and the step to start at."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = next(iter(params)).device.type == "cuda" if params else False
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, total_steps))
    start = 0
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is not None:
        start = load_checkpoint(checkpoint, model, optimizer, scheduler)["step"]
        cb.on_log(f"resuming from {checkpoint.name} (step {start} of {total_steps})")
    return optimizer, scheduler, start


def optimizer_step(s: Session) -> tuple[torch.Tensor, float]:
    """Clip the accumulated gradients (max_grad_norm; 0 = no clipping), step the optimizer and the
    schedule, clear the gradients. Returns (grad norm before clipping, the lr this step used)."""
    params = [p for g in s.optimizer.param_groups for p in g["params"]]
    clip = s.config.max_grad_norm if s.config.max_grad_norm > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
    lr = s.scheduler.get_last_lr()[0]
    s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def train_step(s: Session, step: int) -> dict[str, float]:
    """One optimizer step over `grad_accum` micro-batches; returns its metrics."""
    accum = s.config.grad_accum
    batches = []
    for j in range(accum):
        m = step * accum + j
        batches.append(s.plan.batch(m // len(s.plan), m % len(s.plan)).to(s.device))
    # The loss is summed over every trained token of the window and divided once by their count.
    num_items = sum((shift_labels(b.labels) != IGNORE).sum() for b in batches).clamp(min=1)
    total_loss = torch.zeros((), device=s.device)
    for b in batches:
        out = s.model(
            input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
            labels=b.labels, num_items_in_batch=num_items, use_cache=False,
        )
        out.loss.backward()
        total_loss += out.loss.detach()
    grad_norm, lr = optimizer_step(s)
    tokens = sum(b.tokens for b in batches)
    return {"loss": float(total_loss), "grad_norm": float(grad_norm), "lr": lr, "tokens": tokens,
            "epoch": (step + 1) * accum / len(s.plan)}


def train_loop(s: Session, cb: Callback) -> str:
    """Steps until done or asked to stop; returns the final status."""
    started = time.perf_counter()
    for step in range(s.start_step, s.total_steps):
        t0 = time.perf_counter()
        raw = train_step(s, step)
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        now = time.perf_counter()
        done = step + 1
        elapsed = now - started
        metrics = {
            "step": done, "total_steps": s.total_steps, "epoch": raw["epoch"], "loss": raw["loss"],
            "lr": raw["lr"], "grad_norm": raw["grad_norm"], "tokens_per_s": raw["tokens"] / max(now - t0, 1e-9),
            **memory_metrics(s.device), "elapsed_s": elapsed, **graph_metrics(s.recompute),
            "eta_s": elapsed / (done - s.start_step) * (s.total_steps - done),
        }
        stop = end_of_step(s, cb, done, metrics)
        if stop:
            return stop
    return "completed"


def graph_metrics(recompute: Recompute | None) -> dict[str, float]:
    """`cuda_graphs`: 1 when the step's last forward ran as CUDA graphs, else 0 (with checkpointing)."""
    return {} if recompute is None else {"cuda_graphs": float(recompute.graphed)}


def end_of_step(s: Any, cb: Callback, done: int, metrics: dict[str, float]) -> str | None:
    """Shared by SFT and GRPO: report the step, checkpoint when due or asked to stop, and return
    the final status (cancelled / interrupted) when the run must end here."""
    if done % s.config.logging_steps == 0 or done == s.total_steps:
        cb.on_step(metrics)
    stop = cb.should_stop()
    if stop or (s.config.save_steps and done % s.config.save_steps == 0 and done < s.total_steps):
        path = save_checkpoint(s.output_dir, done, s.model, s.optimizer, s.scheduler, {"total_steps": s.total_steps})
        cb.on_checkpoint(done, str(path))
    if stop:
        return "cancelled" if stop == "cancel" else "interrupted"
    return None


def run_recipe(setup_fn: Any, loop_fn: Any, config: TrainConfig, output_dir: Path, cb: Callback) -> tuple[str, int]:
    """Set up, train and save (SFT and GRPO alike); returns (status, last step)."""
    s = setup_fn(config, output_dir, cb)
    cb.on_start(RunInfo(str(output_dir), s.total_steps, s.start_step, str(s.device), config.method))
    status = loop_fn(s, cb) if s.start_step < s.total_steps else "completed"
    if status == "completed":
        path = save_weights(s.model, output_dir, s.tokenizer)
        cb.on_log(f"saved {path}")
    return status, s.total_steps if status == "completed" else s.scheduler.last_epoch


def run_sft(config: TrainConfig, output_dir: Path, cb: Callback) -> tuple[str, int]:
    """Set up, train and save; returns (status, last step)."""
    return run_recipe(setup, train_loop, config, output_dir, cb)
