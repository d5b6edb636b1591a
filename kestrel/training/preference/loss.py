"""The preference objectives, on sequence log-probs (TRL's definitions; tests compare with TRL).

Shapes: P pairs; `*_logps` are (P,) sums of answer-token log-probs, `*_tokens` (P,) answer
lengths; the reference's log-probs come from the base with the adapter disabled (or precomputed).

    DPO    h = (log pi_c - log ref_c) - (log pi_r - log ref_r)
           sigmoid  -log sigma(beta h)                      (Rafailov et al.)
           hinge    max(0, 1 - beta h)                      (SLiC)
           ipo      (h' - 1 / (2 beta))^2,  h' the same difference of per-token means (IPO, as TRL)
           robust   (-(1 - e) log sigma(beta h) + e log sigma(-beta h)) / (1 - 2e)   (e: label_smoothing)
           exo_pair q log(q / (1 - e)) + (1 - q) log((1 - q) / e),  q = sigma(beta h)   (EXO, K = 2)
           with c = beta (log pi_c - log ref_c), r = beta (log pi_r - log ref_r):
           nca_pair -log sigma(c) - log sigma(-c) / 2 - log sigma(-r) / 2
           bco_pair -log sigma(c) - log sigma(-r)
           sppo_hard (c/beta - 1/(2 beta))^2 + (r/beta + 1/(2 beta))^2
           apo_zero 1 - sigma(c) + sigma(r);   apo_down  sigma(c) + 1 - sigma(c - r)
           rewards  beta (log pi - log ref), per answer
    ORPO   mean log-probs a_c, a_r;  log odds(a) = a - log(1 - e^a)
           L = NLL(chosen) - beta * mean log sigma(log odds(a_c) - log odds(a_r))    (beta: the paper's lambda)
           NLL is the chosen answers' mean token NLL, as in the paper (TRL also counts prompt tokens)
           rewards  beta a
    SimPO  L = -log sigma(beta (a_c - a_r) - gamma) + cpo_alpha * NLL(chosen);  rewards beta a
    KTO    (unpaired rows, label y)  z = beta (log pi - log ref)
           desirable    w_d (1 - sigma(z - beta KL)),  undesirable  w_u (1 - sigma(beta KL - z))
           KL = max(0, mean over mismatched (prompt, answer) rows of log pi - log ref), no gradient

Gradients flow to the policy log-probs only: d(-log sigma(beta h))/d log pi_c = -beta sigma(-beta h)
(and +beta sigma(-beta h) for the rejected answer), which the chunked log-prob kernel carries back
to the hidden states and the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PairLoss:
    """A (micro-)batch's loss (mean over its pairs) and its per-pair rewards (detached)."""

    loss: torch.Tensor  # () with grad
    chosen_rewards: torch.Tensor  # (P,)
    rejected_rewards: torch.Tensor  # (P,)
    extra: dict[str, torch.Tensor]  # detached scalars: nll_loss, log_odds_ratio (ORPO)


def dpo_loss(
    chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
    beta: float, loss_type: str, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
    label_smoothing: float = 0.0,
) -> PairLoss:
    """DPO and its variants (`DPO_LOSS_TYPES`, see the module docstring) over P pairs (all inputs (P,))."""
    chosen_ratio = chosen_logps - ref_chosen_logps  # (P,) log pi / ref of the chosen answer
    rejected_ratio = rejected_logps - ref_rejected_logps
    if loss_type == "ipo":  # per-token means, so the squared target does not scale with length
        mean_delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (mean_delta - 1 / (2 * beta)) ** 2
    else:
        losses = _pair_losses(loss_type, beta, chosen_ratio, rejected_ratio, label_smoothing)
    return PairLoss(losses.mean(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), {})


def _pair_losses(loss_type: str, beta: float, chosen_ratio: torch.Tensor, rejected_ratio: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """(P,) per-pair losses of the DPO variants defined on the two log-ratios alone."""
    h, c, r = beta * (chosen_ratio - rejected_ratio), beta * chosen_ratio, beta * rejected_ratio
    if loss_type == "sigmoid":
        return -F.logsigmoid(h)
    if loss_type == "hinge":
        return torch.relu(1 - h)
    if loss_type == "robust":  # unbiased under labels flipped with probability eps (Chowdhury et al.)
        return (-(1 - eps) * F.logsigmoid(h) + eps * F.logsigmoid(-h)) / (1 - 2 * eps)
    if loss_type == "exo_pair":  # KL(softmax of the two rewards || [1 - eps, eps])
        q, logq, logq_flip = torch.sigmoid(h), F.logsigmoid(h), F.logsigmoid(-h)
        return q * (logq - math.log1p(-eps)) + (1 - q) * (logq_flip - math.log(eps))
    if loss_type == "nca_pair":
        return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)
    if loss_type == "bco_pair":
        return -F.logsigmoid(c) - F.logsigmoid(-r)
    if loss_type == "sppo_hard":  # the log-ratios' targets are +-1 / (2 beta)
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if loss_type == "apo_zero":  # chosen answers better than the model's own: raise them, lower the rejected
        return 1 - torch.sigmoid(c) + torch.sigmoid(r)
    if loss_type == "apo_down":  # chosen answers worse than the model's own: lower both, the rejected more
        return torch.sigmoid(c) + 1 - torch.sigmoid(c - r)
    raise ValueError(f"preference.loss_type {loss_type!r} is not a DPO loss")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, without cancellation (branch at -log 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, nll: torch.Tensor, beta: float) -> PairLoss:
    """ORPO: `chosen_mean`, `rejected_mean` (P,) per-token mean log-probs; `nll` () the chosen
    answers' mean token NLL. Returns the loss and beta-scaled mean log-probs as rewards."""
    c, r = chosen_mean.float(), rejected_mean.float()
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))  # (P,) log odds(chosen) - log odds(rejected)
    ratio = F.logsigmoid(log_odds)
    loss = nll - beta * ratio.mean()
    extra = {"nll_loss": nll.detach(), "log_odds_ratio": ratio.mean().detach(), "log_odds_chosen": log_odds.mean().detach()}
    return PairLoss(loss, beta * c.detach(), beta * r.detach(), extra)


def simpo_loss(
    chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, nll: torch.Tensor, beta: float, gamma: float,
    cpo_alpha: float = 0.0,
) -> PairLoss:
    """SimPO (TRL's CPO with loss_type simpo): per-token mean log-probs (P,), a margin gamma; an
    optional NLL on the chosen answers weighted by cpo_alpha."""
    logits = (chosen_mean - rejected_mean) - gamma / beta
    loss = (-F.logsigmoid(beta * logits)).mean() + cpo_alpha * nll
    return PairLoss(loss, beta * chosen_mean.detach(), beta * rejected_mean.detach(), {"nll_loss": nll.detach()})


@dataclass
class KtoLoss:
    loss: torch.Tensor  # () mean over the batch's rows
    rewards: torch.Tensor  # (N,) beta * log pi / ref, detached
    kl: torch.Tensor  # () the batch's KL estimate


def kto_kl(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point: mean log pi / ref over mismatched rows, at least 0, no gradient."""
    return (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def kto_loss(
    logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor, beta: float,
    desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
) -> KtoLoss:
    """KTO over N unpaired rows: logps, ref_logps (N,), labels (N,) bool (desirable)."""
    ratio = logps - ref_logps  # (N,)
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    losses = torch.where(labels, desirable, undesirable)
    return KtoLoss(losses.mean(), beta * ratio.detach(), kl)
