"""The GRPO objective: group-normalised advantages and the clipped policy loss with a KL term.

Shapes: S completions (rows) per step, grouped consecutively by prompt (G rows a group), L the
longest completion; per-token tensors are (S, L) with a mask m (1 on completion tokens).

    advantages     A_i = (r_i - mean_g r) / (std_g r + eps)      (Dr. GRPO: no division by std)
    ratio          rho_it = exp(logp_it - logp_old_it)           (1 at the first update of a batch)
    surrogate      l_it = -min(rho A_i, clip(rho, 1 - eps, 1 + eps) A_i) + beta * kl_it
    KL (k3)        kl_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1  >= 0, unbiased for
                   KL(pi || ref) under samples from pi, zero exactly when pi == ref
    grpo           L = 1/S sum_i (sum_t m l / sum_t m)            sequence mean, then batch mean
    dapo           L = sum_it m l / sum_it m                      every token weighs the same
    dr_grpo        L = sum_it m l / (S * max_completion_length)   a constant: no length bias

The gradient of the surrogate where unclipped is -A_i rho_it d logp_it; where the ratio is
clipped in the direction A favours it is 0 (the "clip fraction" counts those tokens).
"""

from __future__ import annotations

import torch
from kestrel.constants import GRPO_LOSS_TYPES

LOSS_TYPES = GRPO_LOSS_TYPES


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """rewards (S,) with S = groups * group_size, rows of one prompt adjacent -> advantages (S,).

    scale=True divides by the group's (unbiased) standard deviation (GRPO, DAPO); Dr. GRPO
    (scale=False) only centres, which does not up-weight groups whose rewards barely differ.
    A group whose rewards are all equal gets advantages 0: it carries no learning signal.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} is not a flat multiple of group_size={group_size}")
    r = rewards.float().view(-1, group_size)  # (P, G)
    centred = r - r.mean(dim=1, keepdim=True)  # (P, G)
    if scale:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)  # (S,)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "grpo",
    epsilon: float = 0.2,
    beta: float = 0.0,
    max_completion_length: int | None = None,
    num_sequences: int | torch.Tensor | None = None,
    num_tokens: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of a (micro-)batch, scaled so that micro-batches sum to the loss of the whole step.

    logp (s, L) fp32 with grad; old_logp, ref_logp (s, L) without (ref None when beta == 0);
    advantages (s,); mask (s, L). `num_sequences` S and `num_tokens` (masked tokens) are the
    step's totals (default: this batch's) so that summing the losses of micro-batches equals the
    loss of the step. Returns (loss, stats); stats hold sums over this batch, no host sync:
    `kl_sum` (of kl over masked tokens), `clipped` (tokens with zero gradient from the clip),
    `tokens` (masked tokens).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    m = mask.to(logp.dtype)  # (s, L)
    adv = advantages.to(logp.dtype)[:, None]  # (s, 1): one advantage for every token of a row
    ratio = torch.exp(logp - old_logp)  # (s, L) importance ratio pi / pi_old
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)  # pessimistic (PPO) surrogate
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        delta = ref_logp - logp  # log(ref / pi)
        kl = torch.exp(delta) - delta - 1.0  # k3: >= 0, = 0 iff equal
        per_token = per_token + beta * kl
    s = logp.shape[0] if num_sequences is None else num_sequences
    if loss_type == "grpo":  # mean over each sequence's tokens, then over sequences
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / s
    elif loss_type == "dapo":  # one mean over every token of the step
        loss = (per_token * m).sum() / (m.sum() if num_tokens is None else num_tokens)
    else:  # dr_grpo: a constant normaliser, so long and short answers are not re-weighted
        if max_completion_length is None:
            raise ValueError("dr_grpo needs max_completion_length")
        loss = (per_token * m).sum() / (s * max_completion_length)
    # A clipped token has zero gradient: the ratio left the trust region in A's favoured direction.
    clip = ((ratio < 1.0 - epsilon) & (adv < 0)) | ((ratio > 1.0 + epsilon) & (adv > 0))
    stats = {"kl_sum": (kl.detach() * m).sum(), "clipped": (clip.to(m.dtype) * m).sum(), "tokens": m.sum()}
    return loss, stats
