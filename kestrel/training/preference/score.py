"""Scoring a micro-batch of preference rows: the policy's answer log-probs in one forward, the
reference's (adapter disabled, or a precomputed table), the method's loss and its per-row stats.
Training (`trainer.py`, with gradients) and evaluation (`evaluation.py`, in no_grad) both call
`micro_loss`, each with its own `RowSet`, so eval_loss is the training objective on held-out rows.

    stats = StepStats(torch.zeros(()))
    loss = micro_loss(s, rows, idx, stats)         # () mean over the micro-batch's rows
    staged = stage_metrics(stats, True, world, shared={"grad_norm": g})  # on its way to the host
    staged.read()  # TRL's names: each a mean over the step's rows of every rank (a metric with no row left out)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kestrel.data.preference_tokens import PreferenceSample
from kestrel.model.attention import to_device_async
from kestrel.training.distributed import World
from kestrel.training.recipe import stage_to_host
from kestrel.training.preference import loss as L
from kestrel.training.preference.reference import NEEDS_REFERENCE, RefTable, as_reference, sequence_logps
from kestrel.training.preference.rows import AnswerRows, answer_logprobs, answer_rows, shared_answer_rows


@dataclass
class RowSet:
    """The rows a micro-batch's indices point into: the training rows or the eval rows, with their
    precomputed reference log-probs (None: scored with the adapter disabled) and, for KTO, whose
    answer each row's KL row borrows."""

    samples: list[PreferenceSample]
    reference: RefTable | None = None
    partner: list[int] | None = None


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


def reference_logps(s: Any, data: RowSet, idx: list[int], rows: AnswerRows) -> torch.Tensor:
    """(R,) reference log-probs of the micro-batch's rows (answer-major), scored on the same
    `rows` the policy scores."""
    if data.reference is not None:
        return data.reference.answers[idx].t().reshape(-1)  # (A, P) -> answer-major, as the rows are
    with as_reference(s.model, s.adapter_layers, getattr(s, "recompute", None)):
        return answer_logprobs(s.model, rows).sum(-1)


def _kto_kl(s: Any, data: RowSet, idx: list[int]) -> torch.Tensor:
    """KTO's KL estimate over the micro-batch's mismatched rows (no gradient)."""
    assert data.partner is not None
    rows = [(data.samples[i].prompt, data.samples[data.partner[i]].answers[0]) for i in idx]
    with torch.no_grad():
        policy = sequence_logps(s.model, rows, s.pad_id, s.device, s.flat)
    if data.reference is not None and data.reference.kl is not None:
        ref = data.reference.kl[idx]
    else:
        with as_reference(s.model, s.adapter_layers, getattr(s, "recompute", None)):
            ref = sequence_logps(s.model, rows, s.pad_id, s.device, s.flat)
    return L.kto_kl(policy, ref)


def scored_rows(s: Any, samples: list[PreferenceSample]) -> AnswerRows:
    """The micro-batch's rows, answer-major (all chosen answers, then all rejected): each pair's
    prompt scored once (`s.share_prompt`, paired rows) or with each of its answers."""
    if s.share_prompt and len(samples[0].answers) > 1:
        return shared_answer_rows([(x.prompt, x.answers) for x in samples], s.pad_id, s.device)
    pairs = [(x.prompt, x.answers[k]) for k in range(len(samples[0].answers)) for x in samples]
    return answer_rows(pairs, s.pad_id, s.device, s.flat)


def micro_loss(s: Any, data: RowSet, idx: list[int], stats: StepStats) -> torch.Tensor:
    """The loss of one micro-batch of `data` (a mean over its rows), its stats added to `stats`.
    `s`: the run (config, model, pad_id, device, flat, share_prompt)."""
    p, method = s.config.preference, s.config.method
    chosen = [data.samples[i] for i in idx]
    ahead = getattr(s, "ahead", None)  # the rows and reference queued during the previous step (`ahead.py`)
    early = ahead.take(data, idx) if ahead is not None else None
    rows = early[0] if early is not None else scored_rows(s, chosen)
    # The no-gradient passes first: their activations are gone before the policy's forward keeps
    # its checkpoints for the backward, so the two never sit in memory together.
    ref = early[1] if early is not None else reference_logps(s, data, idx, rows) if method in NEEDS_REFERENCE else None
    kl = _kto_kl(s, data, idx) if method == "kto" else None
    logp = answer_logprobs(s.model, rows)  # (R, L)
    seq, tokens = logp.sum(-1), rows.tokens.to(logp.dtype)  # (R,)
    stats.tokens += rows.real_tokens
    if method == "kto":
        labels = to_device_async(torch.tensor([bool(x.label) for x in chosen]), s.device)
        out = L.kto_loss(seq, ref, labels, kl, p.beta, p.desirable_weight, p.undesirable_weight)
        stats.chosen.append(out.rewards[labels])
        stats.rejected.append(out.rewards[~labels])
        stats.logps_chosen.append(seq.detach()[labels])
        stats.logps_rejected.append(seq.detach()[~labels])
        stats.extra.setdefault("kl", []).append(out.kl.reshape(1))
        return out.loss
    n = len(idx)
    if method == "dpo":
        out = L.dpo_loss(seq[:n], seq[n:], ref[:n], ref[n:], p.beta, p.loss_type, tokens[:n], tokens[n:],
                         p.label_smoothing)
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


def _joined(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat(parts).double() if parts else torch.zeros(0, dtype=torch.float64, device=device)


@dataclass
class StagedMetrics:
    """A step's metric sums, reduced over the ranks and on their way to host memory behind an
    event (`stage_metrics`): `read` waits for the step's work only, not for work queued after it
    (the next step's reference pass, `ahead.py`)."""

    names: list[str]
    values: torch.Tensor  # (1 + 2 x names + extras,) float64 on the host (pinned on CUDA)
    done: Any  # torch.cuda.Event once the copy is queued, or None (nothing to wait for)
    paired: bool
    extras: list[str]
    ranks: list[int]  # per extra: what its sum over the ranks is divided by (1: a sum; N: a value every rank shares)

    def read(self) -> dict[str, float]:
        if self.done is not None:
            self.done.synchronize()
        values = self.values.tolist()
        out = {"loss": values[0]}
        for i, name in enumerate(self.names):
            total, count = values[1 + 2 * i], values[2 + 2 * i]
            if count:
                out[name] = total / count
        if not self.paired and "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        out.update((k, v / r) for k, v, r in zip(self.extras, values[1 + 2 * len(self.names):], self.ranks))
        return out


def stage_metrics(stats: StepStats, paired: bool, world: World | None = None,
                  summed: dict[str, torch.Tensor] | None = None, shared: dict[str, torch.Tensor] | None = None,
                  ) -> StagedMetrics:
    """The step's metrics under TRL's names (see trainer.py's docstring), each a mean over the step's
    rows (pairs; KTO: its desirable or undesirable rows; the extras: micro-batches) of every rank
    from its (sum, count), with the loss, and scalars `summed` over the ranks or `shared` by every rank (the
    gradient norm), reduced in one all-reduce and copied to host memory without waiting (see
    `StagedMetrics`)."""
    world = world or World()
    extras = {**(summed or {}), **(shared or {})}
    ranks = [1] * len(summed or {}) + [world.size] * len(shared or {})
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
                        torch.full((), float(parts[n].numel()), dtype=torch.float64, device=device))),
                        *(x.detach().double().reshape(()).to(device) for x in extras.values())])
    return StagedMetrics(names, *stage_to_host(world.sum(sums)), paired, list(extras), ranks)
