"""GRPO, read top to bottom: setup, then each step rollout -> reward -> score -> update.

    status, last_step = run_grpo(config, output_dir, cb)   # cb: one `Callback` (a `CallbackList`)

1. setup: rewards built first (a misconfigured reward fails before any model loads); seed; load
   the model patched (NF4 with `grpo.load_in_4bit`); attach LoRA. The reference policy is the same
   model with its adapter disabled: no second copy of the weights. Prompts tokenized once; one
   decode `Generator` for the whole run; AdamW, schedule, resume as in SFT.
2. rollout: a step takes `batch_size * grad_accum` prompts (on each rank) and samples
   `num_generations` completions for each through the decode path, `batch_size` prompts per
   decode batch; the decode cache is freed before the update so the two never hold memory together.
3. reward: every completion scored (weighted sum of the rewards); advantages normalised per group.
4. score, no grad: reference log-probs with the adapter disabled (beta > 0), and the sampling
   policy's when a batch feeds several updates (`num_iterations` > 1).
5. update: rows run in micro-batches of at most `max_seq_length` tokens (one row at least); each
   micro-batch's loss is scaled by the step's totals, so they sum to the loss of the whole step.

On several devices (`kestrel.training.distributed`) N ranks with grad_accum k train as one device
with grad_accum N k. A step's N k batch_size prompts are split in N consecutive shares, rank r
taking share r; every prompt's group of completions stays on the rank that sampled it, so rewards
and group advantages need no communication. Each decode batch keeps the seed it has on one
device (from its place in the step), so the ranks sample the rollouts one process would. The
loss is normalised by the step's totals over all ranks (sequences, completion tokens: one
all-reduce before the forwards), so the summed adapter gradients (one all-reduce, as for SFT) are
one device's. The metrics are reduced over the ranks: the per-completion values (rewards,
lengths, stops) gathered in rank order, the update's sums (loss, KL, clipped tokens) summed; rank 0
reports them. Evaluation measures a share of the held-out prompts on each rank.

Metrics per step, besides SFT's (step, total_steps, epoch, loss, lr, grad_norm, memory, elapsed_s,
eta_s): `reward`, `reward_std` (over the step's completions), `reward/<name>` (each reward's mean,
unweighted), `frac_reward_zero_std` (groups with no signal), `kl` (k3, per completion token; only
with beta > 0), `clip_frac` (completion tokens whose gradient the clip removed),
`completion_len_mean/_max`, `completion_stopped_frac` (rows that ended with a stop token),
`rollout_s`, `update_s`, and `tokens_per_s` (prompt + completion tokens of the step's rows per
second of the whole step). With an evaluation set: `eval_reward`, `eval_reward/<name>`
(`kestrel.training.grpo.evaluation`).
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
from kestrel.decode.generate import Generator
from kestrel.training.evaluation import Evaluator
from kestrel.training.grpo.data import PromptRow, load_prompts, prompts_for_step
from kestrel.training.grpo.evaluation import grpo_evaluator, held_out_prompts
from kestrel.training.grpo.logprobs import check_lm_head, completion_logprobs, pack_rows
from kestrel.training.grpo.loss import group_advantages, policy_loss
from kestrel.training.grpo.rewards import RewardBatch, RewardSet
from kestrel.training.grpo.rollout import Rollouts, release, rollout
from kestrel.model.loader import load
from kestrel.model.lora import trainable_parameters
from kestrel.training.distributed import World
from kestrel.training.metrics import Callback
from kestrel.training.recipe import (
    optimizer_and_resume, optimizer_step, prepare_model, report_step, run_recipe, seed_everything, step_end,
)


@dataclass
class GrpoSession:
    """Everything a run holds between setup and the end."""

    config: TrainConfig
    output_dir: Path
    model: nn.Module
    tokenizer: Any
    prompts: list[PromptRow]
    rewards: RewardSet
    generator: Generator
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    total_steps: int
    start_step: int
    device: torch.device
    world: World = field(default_factory=World)  # this rank of a run on several devices
    evaluator: Evaluator | None = None  # with an evaluation set (eval_dataset / eval_split)

    @property
    def prompts_per_rank(self) -> int:
        return self.config.batch_size * self.config.grad_accum

    @property
    def prompts_per_step(self) -> int:
        """Prompts an optimizer step takes over every rank."""
        return self.prompts_per_rank * self.world.size


@dataclass
class MicroBatch:
    """Rows updated together: device tensors, plus their no-grad scores once computed."""

    ids: torch.Tensor  # (r, T) prompt + completion, right-padded
    starts: torch.Tensor  # (r,) first completion column
    targets: torch.Tensor  # (r, L) completion ids, -100 past the end
    advantages: torch.Tensor  # (r,)
    ref: torch.Tensor | None = None  # (r, L) reference log-probs (beta > 0)
    old: torch.Tensor | None = None  # (r, L) sampling-policy log-probs (num_iterations > 1)

    @property
    def mask(self) -> torch.Tensor:
        return self.targets != -100


@dataclass
class StepBatch:
    """One step's rollouts, their rewards and the micro-batches the update runs over."""

    rollouts: Rollouts  # this rank's S rows
    rewards: torch.Tensor  # (S,) weighted total
    parts: dict[str, torch.Tensor]  # reward key -> (S,)
    micro: list[MicroBatch]
    sequences: int  # rows of the step over every rank
    completion_tokens: int  # over every rank
    prompt_tokens: int  # over every rank
    rollout_s: float


# --- 1. setup ---------------------------------------------------------------------------------


def _generator(model: nn.Module, tokenizer: Any, max_len: int) -> Generator:
    # A family without Kestrel's decode forward samples through HF's (the generator says so).
    return Generator(model, tokenizer, max_seq_len=max_len)


def setup(config: TrainConfig, output_dir: Path, cb: Callback, world: World) -> GrpoSession:
    g = config.grpo
    rewards = RewardSet(g.rewards, allow_custom=g.allow_custom_rewards)
    seed_everything(config.seed)
    max_len = g.max_prompt_length + g.max_completion_length
    model, tokenizer = load(config.model, max(config.max_seq_length, max_len),
                            load_in_4bit=config.grpo.load_in_4bit,
                            dtype=config.dtype, patch=config.fast_kernels)
    device = next(model.parameters()).device
    prompts, bad, too_long = load_prompts(config, tokenizer, rewards.needs_answers)
    cb.on_log(f"dataset {config.dataset}: {len(prompts)} prompts, {len(bad)} bad rows skipped"
              + (f", {too_long} longer than grpo.max_prompt_length skipped" if too_long else ""))
    if bad:
        cb.on_log("bad rows: " + "; ".join(f"line {b.line}: {b.reason}" for b in bad[:5]))
    prompts, held = held_out_prompts(config, prompts, tokenizer, rewards.needs_answers, cb)
    model, _ = prepare_model(config, model, output_dir, cb, world)  # LoRA on a frozen base (GRPO never trains all weights)
    check_lm_head(model)
    trainable, total = trainable_parameters(model)
    cb.on_log(f"model {config.model} (grpo): {trainable:,} of {total:,} parameters trainable, on {device}")
    per_step = config.batch_size * config.grad_accum * world.size
    total_steps = config.max_steps or max(1, math.ceil((config.epochs or 1.0) * len(prompts) / per_step))
    optimizer, scheduler, start = optimizer_and_resume(config, model, total_steps, output_dir, cb)
    generator = _generator(model, tokenizer, max_len)
    s = GrpoSession(config, output_dir, model, tokenizer, prompts, rewards, generator, optimizer, scheduler,
                    total_steps, start, device, world)
    s.evaluator = grpo_evaluator(config, s, held, cb)
    return s


# --- 2-4. rollout, reward, score ------------------------------------------------------------


def split_rows(widths: list[int], budget: int) -> list[slice]:
    """Consecutive row slices whose padded size (rows * widest row) stays within `budget` tokens."""
    out, lo, widest = [], 0, 0
    for i, w in enumerate(widths):
        widest_with = max(widest, w)
        if i > lo and (i - lo + 1) * widest_with > budget:
            out.append(slice(lo, i))
            lo, widest_with = i, w
        widest = widest_with
    out.append(slice(lo, len(widths)))
    return out


def _micro_batches(s: GrpoSession, ro: Rollouts, advantages: torch.Tensor) -> list[MicroBatch]:
    widths = [len(p) + len(c) for p, c in zip(ro.prompt_ids, ro.completion_ids)]
    pad = s.tokenizer.pad_token_id if s.tokenizer.pad_token_id is not None else 0
    out = []
    for sl in split_rows(widths, s.config.max_seq_length):
        ids, starts, targets = pack_rows(ro.prompt_ids[sl], ro.completion_ids[sl], pad, s.device)
        out.append(MicroBatch(ids, starts, targets, advantages[sl].to(s.device)))
    return out


def rank_prompts(s: GrpoSession, step: int) -> tuple[list[PromptRow], int]:
    """This rank's prompts of step `step` (share `rank` of the step's prompts over every rank, in
    order) and where they start among the step's prompts."""
    rows = prompts_for_step(s.prompts, step, s.prompts_per_step, s.config.seed)
    lo = s.world.rank * s.prompts_per_rank
    return rows[lo : lo + s.prompts_per_rank], lo


def collect(s: GrpoSession, step: int) -> StepBatch:
    """This rank's rollouts for step `step`, scored: rewards, advantages, micro-batches (no grad)."""
    g, t0 = s.config.grpo, time.perf_counter()
    rows, lo = rank_prompts(s, step)
    adapter = getattr(s.model, "active_adapter", None)
    ro = Rollouts([], [], [], [])
    for j in range(0, len(rows), s.config.batch_size):
        # distinct per row and step, and the same decode batch gets the same seed on any number of ranks
        seed = s.config.seed + (step * s.prompts_per_step + lo + j) * g.num_generations
        ro.extend(rollout(s.generator, s.tokenizer, [r.ids for r in rows[j : j + s.config.batch_size]],
                          g.num_generations, g.max_completion_length, g.temperature, g.top_p, seed, adapter))
    release(s.generator)
    per_row = [r for r in rows for _ in range(g.num_generations)]  # (S,) the prompt of each row
    batch = RewardBatch([r.text for r in per_row], ro.texts, [r.answer for r in per_row],
                        [len(c) for c in ro.completion_ids])
    total, parts = s.rewards(batch)  # (S,), {key: (S,)}
    advantages = group_advantages(total, g.num_generations, scale=g.loss_type != "dr_grpo")
    micro = _micro_batches(s, ro, advantages)
    score(s, micro)
    counts = torch.tensor([sum(batch.lengths), sum(len(p) for p in ro.prompt_ids)])  # (2,) int64
    completion, prompt = s.world.sum(counts.to(s.device)).tolist()  # the step's totals: the loss's normalisers
    return StepBatch(ro, total, parts, micro, len(ro) * s.world.size, int(completion), int(prompt),
                     time.perf_counter() - t0)


@torch.no_grad()
def score(s: GrpoSession, micro: list[MicroBatch]) -> None:
    """Reference log-probs (adapter disabled) and, for reused batches, the sampling policy's."""
    g = s.config.grpo
    reuse = s.config.grpo.num_iterations > 1
    if g.beta == 0 and not reuse:
        return
    s.model.eval()  # no-grad passes: nothing to checkpoint
    try:
        for mb in micro:
            if g.beta > 0:
                with s.model.disable_adapter():
                    mb.ref = completion_logprobs(s.model, mb.ids, mb.starts, mb.targets, g.temperature)
            if reuse:
                mb.old = completion_logprobs(s.model, mb.ids, mb.starts, mb.targets, g.temperature)
    finally:
        s.model.train()


# --- 5. update --------------------------------------------------------------------------------


def update(s: GrpoSession, batch: StepBatch) -> dict[str, float]:
    """One optimizer step over every micro-batch of `batch`; returns the update's metrics."""
    g = s.config.grpo
    num_seq, num_tok = batch.sequences, max(1, batch.completion_tokens)
    sums = {key: torch.zeros((), device=s.device) for key in ("loss", "kl_sum", "clipped", "tokens")}
    for mb in batch.micro:
        logp = completion_logprobs(s.model, mb.ids, mb.starts, mb.targets, g.temperature)  # (r, L)
        old = mb.old if mb.old is not None else logp.detach()  # first update of a batch: ratio 1
        loss, stats = policy_loss(logp, old, mb.ref, mb.advantages, mb.mask, g.loss_type, g.epsilon, g.beta,
                                  g.max_completion_length, num_sequences=num_seq, num_tokens=num_tok)
        loss.backward()
        sums["loss"] += loss.detach()
        for key in ("kl_sum", "clipped", "tokens"):
            sums[key] = sums[key] + stats[key]
    loss, kl_sum, clipped, tokens = s.world.sum(torch.stack(list(sums.values())).float())  # every rank's part
    grad_norm, lr = optimizer_step(s, loss)
    tokens = tokens.clamp(min=1)
    # One host read per step, for the metrics. No reference pass when beta == 0: no `kl` to report.
    out = {"loss": float(loss), "grad_norm": float(grad_norm), "lr": lr, "clip_frac": float(clipped / tokens)}
    if g.beta > 0:
        out["kl"] = float(kl_sum / tokens)
    return out


def batch_metrics(batch: StepBatch, group_size: int, world: World) -> dict[str, float]:
    """Reward and completion statistics of a step's rollouts over every rank: each rank's
    per-completion values gathered in rank order (the order of one device's rows)."""
    ro, keys = batch.rollouts, sorted(batch.parts)
    mine = torch.stack([batch.rewards.float(), *(batch.parts[k].float() for k in keys),
                        torch.tensor([float(len(c)) for c in ro.completion_ids]),
                        torch.tensor([float(x) for x in ro.stopped])])  # (2 + parts, S) fp32: lengths exact
    rewards, *parts, lengths, stopped = world.gather_columns(mine).cpu()  # each (S over every rank,)
    groups = rewards.view(-1, group_size)
    out = {"reward": float(rewards.mean()), "reward_std": float(rewards.std(correction=0)),
           "frac_reward_zero_std": float((groups.std(dim=1, correction=0) < 1e-8).float().mean()),
           "completion_len_mean": float(lengths.double().mean()), "completion_len_max": float(lengths.max()),
           "completion_stopped_frac": float(stopped.double().mean()), "rollout_s": batch.rollout_s}
    out.update({f"reward/{key}": float(v.mean()) for key, v in zip(keys, parts)})
    return out


def train_loop(s: GrpoSession, cb: Callback) -> str:
    """Steps until done or asked to stop; returns the final status."""
    iterations = max(1, s.config.grpo.num_iterations)
    started, batch = time.perf_counter(), None
    for step in range(s.start_step, s.total_steps):
        t0 = time.perf_counter()
        if batch is None or step % iterations == 0:
            batch = collect(s, step)
        t1 = time.perf_counter()
        raw = update(s, batch)
        now = step_end(s.device)
        metrics = {"epoch": (step + 1) * s.prompts_per_step / len(s.prompts), **raw,
                   **batch_metrics(batch, s.config.grpo.num_generations, s.world), "update_s": now - t1}
        stop = report_step(s, cb, step, metrics, batch.prompt_tokens + batch.completion_tokens, started, t0, now)
        if stop:
            return stop
    return "completed"


def run_grpo(config: TrainConfig, output_dir: Path, cb: Callback, world: World | None = None) -> tuple[str, int]:
    """Set up, train and save; returns (status, last step)."""
    return run_recipe(setup, train_loop, config, output_dir, cb, world)
