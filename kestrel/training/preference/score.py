"""Scoring a micro-batch of preference rows: the policy's answer log-probs in one forward, the
reference's (adapter disabled, or a precomputed table), the method's loss and its per-row stats.
Training (`trainer.py`, with gradients) and evaluation (`evaluation.py`, in no_grad) both call
`micro_loss`, each with its own `RowSet`, so eval_loss is the training objective on held-out rows.

    stats = StepStats(torch.zeros(()))
    loss = micro_loss(s, rows, idx, stats)        # () mean over the micro-batch's rows
    preference_metrics(stats, paired=True)        # TRL's names: rewards/chosen, rewards/margins, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kestrel.data.preference_tokens import PreferenceSample
from kestrel.training.preference import loss as L
from kestrel.training.preference.reference import RefTable, as_reference, sequence_logps
from kestrel.training.preference.rows import answer_logprobs, answer_rows


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


def _reference(s: Any, data: RowSet, idx: list[int], pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """(R,) reference log-probs of the micro-batch's rows, in `pairs` order (answer-major)."""
    if data.reference is not None:
        return data.reference.answers[idx].t().reshape(-1)  # (A, P) -> answer-major, as the rows are
    with as_reference(s.model):
        return sequence_logps(s.model, pairs, s.pad_id, s.device, s.flat)


def _kto_kl(s: Any, data: RowSet, idx: list[int]) -> torch.Tensor:
    """KTO's KL estimate over the micro-batch's mismatched rows (no gradient)."""
    assert data.partner is not None
    rows = [(data.samples[i].prompt, data.samples[data.partner[i]].answers[0]) for i in idx]
    with torch.no_grad():
        policy = sequence_logps(s.model, rows, s.pad_id, s.device, s.flat)
    if data.reference is not None and data.reference.kl is not None:
        ref = data.reference.kl[idx]
    else:
        with as_reference(s.model):
            ref = sequence_logps(s.model, rows, s.pad_id, s.device, s.flat)
    return L.kto_kl(policy, ref)


def micro_loss(s: Any, data: RowSet, idx: list[int], stats: StepStats) -> torch.Tensor:
    """The loss of one micro-batch of `data` (a mean over its rows), its stats added to `stats`.
    `s`: the run (config, model, pad_id, device, flat)."""
    p, method = s.config.preference, s.config.method
    chosen = [data.samples[i] for i in idx]
    pairs = [(x.prompt, x.answers[k]) for k in range(len(chosen[0].answers)) for x in chosen]  # answer-major
    rows = answer_rows(pairs, s.pad_id, s.device, s.flat)
    logp = answer_logprobs(s.model, rows)  # (R, L)
    seq, tokens = logp.sum(-1), rows.tokens.to(logp.dtype)  # (R,)
    stats.tokens += rows.real_tokens
    if method == "kto":
        labels = torch.tensor([bool(x.label) for x in chosen], device=s.device)
        out = L.kto_loss(seq, _reference(s, data, idx, pairs), labels, _kto_kl(s, data, idx), p.beta,
                         p.desirable_weight, p.undesirable_weight)
        stats.chosen.append(out.rewards[labels])
        stats.rejected.append(out.rewards[~labels])
        stats.logps_chosen.append(seq.detach()[labels])
        stats.logps_rejected.append(seq.detach()[~labels])
        stats.extra.setdefault("kl", []).append(out.kl.reshape(1))
        return out.loss
    n = len(idx)
    if method == "dpo":
        ref = _reference(s, data, idx, pairs)
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


def _joined(parts: list[torch.Tensor]) -> torch.Tensor | None:
    joined = torch.cat(parts) if parts else None
    return joined if joined is not None and joined.numel() else None


def preference_metrics(stats: StepStats, paired: bool) -> dict[str, float]:
    """TRL's metric names (see trainer.py's docstring), one host read each."""
    out = {"loss": float(stats.loss)}
    chosen, rejected = _joined(stats.chosen), _joined(stats.rejected)
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
