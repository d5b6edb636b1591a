"""Supervised fine-tuning, read top to bottom: setup, train, save.

    status, last_step = run_sft(config, output_dir, cb)   # cb: one `Callback` (a `CallbackList`)

Front ends call `kestrel.training.run.run(config, callbacks)` instead: it resolves `output_dir`,
writes the config, runs this (or GRPO) and turns failures into a `TrainResult`.

1. setup: seed, load the model (NF4 for QLoRA) patched, read + tokenize the dataset, plan batches,
   attach LoRA (or unfreeze everything), checkpointing, optimizer, schedule, resume.
2. train: each step accumulates `grad_accum` micro-batches; the loss is a sum over trained tokens
   divided by the window's token count (so accumulation equals one big batch), then clip, step.
3. save: checkpoints every `save_steps`; at the end `adapter/` (or `model/`) and `config.yaml`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kestrel.recompute.checkpoint import Recompute
from kestrel.config import TrainConfig
from kestrel.data import BatchPlan, Conversation, load_conversations, tokenize_all
from kestrel.data.tokenize import IGNORE
from kestrel.model.forwards import shift_labels
from kestrel.model.loader import load
from kestrel.model.patching import packing_refusal, runs_varlen
from kestrel.model.lora import trainable_parameters
from kestrel.training.distributed import World
from kestrel.training.evaluation import Evaluator
from kestrel.training.metrics import Callback
from kestrel.training.sft_eval import held_out, sft_evaluator
from kestrel.training.recipe import (
    graph_metrics, optimizer_and_resume, optimizer_step, prepare_model, raise_if_diverged, report_step, run_recipe,
    seed_everything, stage_to_host,
)


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
    world: World = field(default_factory=World)  # this rank of a run on several devices
    evaluator: Evaluator | None = None  # with an evaluation set (eval_dataset / eval_split)


def prepare_data(
    config: TrainConfig, tokenizer: Any, cb: Callback, flat: bool = False, packing: bool | None = None
) -> tuple[BatchPlan, list[Conversation]]:
    """The dataset read, the eval rows held out (`held_out`), the rest tokenized and planned into
    batches (`flat`: `BatchPlan`'s; `packing`: None = the config's). Returns the plan and the eval rows."""
    fmt, convs, bad = load_conversations(config.dataset, config.dataset_format, config.columns, config.system_prompt)
    convs, eval_convs = held_out(config, convs, cb)
    data = tokenize_all(tokenizer, convs, config.max_seq_length, config.train_on_responses_only, config.dataset)
    cb.on_log(f"dataset {config.dataset}: format {fmt}, {len(convs)} rows used, {len(bad)} bad rows skipped")
    if bad:
        cb.on_log("bad rows: " + "; ".join(f"line {b.line}: {b.reason}" for b in bad[:5]))
    if data.truncated:
        cb.on_log(f"{data.truncated} rows were longer than max_seq_length={config.max_seq_length} and were truncated")
    if data.fully_masked:
        cb.on_log(f"{data.fully_masked} rows had no trained tokens left and were dropped")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    packing = config.packing if packing is None else packing
    plan = BatchPlan(data.samples, config.batch_size, packing, config.max_seq_length, pad, config.seed, flat)
    return plan, eval_convs


def setup(config: TrainConfig, output_dir: Path, cb: Callback, world: World) -> Session:
    seed_everything(config.seed)
    model, tokenizer = load(
        config.model, config.max_seq_length, load_in_4bit=config.load_in_4bit, dtype=config.dtype, patch=config.fast_kernels
    )
    device = next(model.parameters()).device
    refusal = packing_refusal(model) if config.packing else None
    if refusal:
        cb.on_log(f"packing off: {refusal}; each row holds one sample")
    plan, eval_convs = prepare_data(config, tokenizer, cb, flat=runs_varlen(model),
                                    packing=config.packing and refusal is None)
    model, recompute = prepare_model(config, model, output_dir, cb, world)
    trainable, total = trainable_parameters(model)
    cb.on_log(f"model {config.model} ({config.method}): {trainable:,} of {total:,} parameters trainable, on {device}")
    window = config.grad_accum * world.size  # micro-batches a step takes, over every rank
    total_steps = config.max_steps or max(1, math.ceil((config.epochs or 1.0) * len(plan) / window))
    optimizer, scheduler, start = optimizer_and_resume(config, model, total_steps, output_dir, cb)
    evaluator = sft_evaluator(config, tokenizer, eval_convs, plan, total_steps, output_dir, start, cb, world.size)
    return Session(config, output_dir, model, tokenizer, plan, optimizer, scheduler, total_steps, start, device,
                   recompute, world, evaluator)


@dataclass
class Queued:
    """An SFT step whose work is queued on the device, up to and with its optimizer step and the copy of
    its values to host memory; read (`settle`) once the next step's forward and backward are queued too."""

    step: int  # 0-based
    t0: float  # host time the step began
    lr: float
    values: torch.Tensor  # (3,) float64 on the host (pinned on CUDA): loss, grad norm, real tokens; + router loss
    ended: torch.cuda.Event | None  # recorded after the copy (CUDA): once it is done, `values` hold
    graphs: dict[str, float]  # `graph_metrics` of its own forward (read later, the next step's would show)


def accumulate(s: Session, step: int) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The forward and backward of step `step`'s `grad_accum` micro-batches on this rank; returns
    (the window's summed loss, on the device; each micro-batch's router loss; its real tokens).

    A step's window is micro-batches step*W .. step*W + W-1 (W = grad_accum x ranks); rank r takes
    every size-th of them from r, so N ranks see what one device would with N times grad_accum."""
    accum, world = s.config.grad_accum, s.world
    batches = []
    for j in range(accum):
        m = (step * accum + j) * world.size + world.rank
        batches.append(s.plan.batch(m // len(s.plan), m % len(s.plan)).to(s.device))
    # The loss is summed over every trained token of the window (all ranks) and divided once by their count.
    local_items = sum((shift_labels(b.labels) != IGNORE).sum() for b in batches)
    num_items = world.sum(torch.as_tensor(local_items, device=s.device).clone()).clamp(min=1)
    total_loss = torch.zeros((), device=s.device)
    aux = []  # mixture of experts: each micro-batch's router load-balancing loss
    for b in batches:
        out = s.model(
            input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
            labels=b.labels, num_items_in_batch=num_items, use_cache=False, **b.model_kwargs(),
        )
        (out.loss * world.loss_scale if world.loss_scale != 1.0 else out.loss).backward()
        total_loss += out.loss.detach()
        if getattr(out, "aux_loss", None) is not None:
            aux.append(out.aux_loss.detach())
    return total_loss, aux, sum(b.tokens for b in batches)


def apply(s: Session, step: int, t0: float, window: tuple[torch.Tensor, list[torch.Tensor], int]) -> Queued:
    """Queue the optimizer step over the accumulated gradients with its divergence guard on the device
    (`optimizer_step(checked_later=True)`: `settle` reads it), then the step's values on their way to
    host memory and the step's end: nothing here waits for the GPU."""
    total_loss, aux, tokens = window
    world = s.world
    world.sum(total_loss)
    grad_norm, lr = optimizer_step(s, total_loss, checked_later=True)
    parts = [total_loss, grad_norm, torch.full((), float(tokens), dtype=torch.float64, device=s.device)]  # no copy
    if aux:  # every rank runs the same model: all of them have a router loss, or none
        parts.append(torch.stack(aux).mean() / world.size)
    values = torch.stack([p.detach().double().reshape(()) for p in parts])
    if world.distributed:
        values[2:] = world.sum(values[2:].clone())  # tokens and router losses over every rank
    return Queued(step, t0, lr, *stage_to_host(values), graph_metrics(s.recompute))


def settle(s: Session, cb: Callback, q: Queued, before: Queued | None, started: float) -> str | None:
    """Read step `q` once its work is done (one wait on its end, not on what was queued after it),
    stop the run if it diverged (its update was skipped on the device), and report it. Its time runs
    from the end of the step `before` it on the device (the first: from its start on the host).
    Returns the run's final status when it ends here."""
    if q.ended is not None:
        q.ended.synchronize()
    now = time.perf_counter()
    loss, grad_norm, tokens, *aux = q.values.tolist()
    raise_if_diverged(s, q.step + 1, loss, grad_norm)
    took = (before.ended.elapsed_time(q.ended) / 1000 if before is not None and before.ended is not None
            and q.ended is not None else now - q.t0)
    metrics = {"epoch": (q.step + 1) * s.config.grad_accum * s.world.size / len(s.plan), "loss": loss, "lr": q.lr,
               "grad_norm": grad_norm, **q.graphs, **({"aux_loss": aux[0]} if aux else {})}
    return report_step(s, cb, q.step, metrics, int(tokens), started, now - took, now)


def runs_ahead(device: torch.device) -> bool:
    """Whether the host runs a step ahead of `device`: where work is queued asynchronously (CUDA)."""
    return device.type == "cuda"


def train_loop(s: Session, cb: Callback) -> str:
    """Steps until done or asked to stop; returns the final status.

    On CUDA the host runs a step ahead: step n is read and reported (`settle`) after step n+1's
    forward and backward are queued and before its optimizer step, so the GPU goes from one step's
    work to the next without waiting for the host, and a step that diverged or ends the run is
    still the last one whose update lands. Elsewhere each step is read as soon as it is queued."""
    started = time.perf_counter()
    ahead = runs_ahead(s.device)
    behind: Queued | None = None  # queued, not yet read
    last: Queued | None = None  # the last step read
    for step in range(s.start_step, s.total_steps):
        t0 = time.perf_counter()
        window = accumulate(s, step)
        if behind is not None:
            stop = settle(s, cb, behind, last, started)
            if stop:
                s.optimizer.zero_grad(set_to_none=True)  # step `step`'s gradients, never applied
                return stop
            last, behind = behind, None
        queued = apply(s, step, t0, window)
        if ahead:
            behind = queued
            continue
        stop = settle(s, cb, queued, last, started)
        if stop:
            return stop
        last = queued
    return (settle(s, cb, behind, last, started) if behind is not None else None) or "completed"


def run_sft(config: TrainConfig, output_dir: Path, cb: Callback, world: World | None = None) -> tuple[str, int]:
    """Set up, train and save; returns (status, last step)."""
    return run_recipe(setup, train_loop, config, output_dir, cb, world)
