"""GRPO advantages and losses against a direct, loop-by-loop reference on small tensors: values,
gradients, micro-batch accumulation, clipping and the KL term."""

from __future__ import annotations

import math

import pytest
import torch

from kestrel.training.grpo.loss import group_advantages, policy_loss

F64 = torch.float64  # tensors are float64 so the reference loops can be checked tightly


# --- direct references: one scalar at a time ---------------------------------------------------


def ref_advantages(rewards: list[float], g: int, scale: bool, eps: float = 1e-4) -> list[float]:
    out = []
    for k in range(0, len(rewards), g):
        group = rewards[k : k + g]
        mean = sum(group) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (g - 1))
        out += [(r - mean) / (std + eps) if scale else r - mean for r in group]
    return out


def ref_loss(logp, old, ref, adv, mask, loss_type, eps, beta, max_len) -> torch.Tensor:
    """The objective written term by term: per-token surrogate + beta * k3, then the aggregation."""
    s, length = logp.shape
    seq_terms, total, count = [], 0.0, 0.0
    for i in range(s):
        row_sum, row_count = 0.0, 0.0
        for t in range(length):
            if not mask[i, t]:
                continue
            ratio = torch.exp(logp[i, t] - old[i, t])
            clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
            term = -torch.minimum(ratio * adv[i], clipped * adv[i])
            if ref is not None:
                d = ref[i, t] - logp[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            row_sum, row_count = row_sum + term, row_count + 1
        seq_terms.append(row_sum / max(row_count, 1))
        total, count = total + row_sum, count + row_count
    if loss_type == "grpo":
        return sum(seq_terms) / s
    if loss_type == "dapo":
        return total / count
    return total / (s * max_len)


def _inputs(seed: int, s: int = 6, length: int = 5, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(s, length, generator=g, dtype=F64) * 3
    old = logp + spread * torch.randn(s, length, generator=g, dtype=F64)  # ratios well outside [0.8, 1.2]
    ref = logp + spread * torch.randn(s, length, generator=g, dtype=F64)
    adv = torch.randn(s, generator=g, dtype=F64)
    lengths = torch.randint(1, length + 1, (s,), generator=g)
    mask = torch.arange(length)[None] < lengths[:, None]
    return logp, old, ref, adv, mask


# --- advantages --------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_reference(scale: bool) -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, -1.0, 0.0, 3.0]
    got = group_advantages(torch.tensor(rewards), 4, scale=scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.tensor(ref_advantages(rewards, 4, scale), dtype=F64), rtol=1e-6, atol=1e-6)
    assert got[4:8].abs().max() == 0  # equal rewards: no signal
    assert abs(float(got[:4].sum())) < 1e-6  # centred in each group


def test_group_advantages_reject_ragged_groups() -> None:
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(7), 4)


# --- losses ------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_loss_and_gradient_match_reference(loss_type: str, beta: float) -> None:
    logp, old, ref, adv, mask = _inputs(seed=1)
    ref = ref if beta > 0 else None
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(a, old, ref, adv, mask, loss_type, 0.2, beta, max_completion_length=7)
    want = ref_loss(b, old, ref, adv, mask, loss_type, 0.2, beta, 7)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    loss.backward()
    want.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert a.grad[~mask].abs().max() == 0  # padding gets no gradient
    assert stats["tokens"] == mask.sum()


def test_loss_types_differ_in_how_they_weigh_tokens() -> None:
    logp, old, ref, adv, mask = _inputs(seed=2)
    losses = {t: float(policy_loss(logp, old, None, adv, mask, t, 0.2, 0.0, 9)[0]) for t in ("grpo", "dapo", "dr_grpo")}
    assert len({round(v, 9) for v in losses.values()}) == 3


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_sum_to_the_whole_batch(loss_type: str) -> None:
    logp, old, ref, adv, mask = _inputs(seed=3, s=8)
    whole, _ = policy_loss(logp, old, ref, adv, mask, loss_type, 0.2, 0.05, 5)
    parts = [policy_loss(logp[sl], old[sl], ref[sl], adv[sl], mask[sl], loss_type, 0.2, 0.05, 5,
                         num_sequences=8, num_tokens=mask.sum())[0] for sl in (slice(0, 3), slice(3, 4), slice(4, 8))]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-12, atol=1e-12)


def test_first_update_gradient_is_advantage_weighted_logprob_gradient() -> None:
    """old == logp (detached): ratio 1, no clipping, d loss / d logp = -A m / (S * row length)."""
    logp, _, _, adv, mask = _inputs(seed=4)
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(x, x.detach(), None, adv, mask, "grpo", 0.2, 0.0)
    loss.backward()
    expected = -adv[:, None] * mask / (mask.sum(-1, keepdim=True) * logp.shape[0])
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-12)
    assert stats["clipped"] == 0


def test_clip_zeroes_the_gradient_only_in_the_favoured_direction() -> None:
    old = torch.zeros(4, 1, dtype=F64)
    logp = torch.tensor([[0.5], [0.5], [-0.5], [-0.5]], dtype=F64, requires_grad=True)  # ratios e^+-0.5
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=F64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, None, adv, mask, "dapo", 0.2, 0.0)
    loss.backward()
    # Row 0: ratio above 1.2 with A > 0 -> clipped. Row 2: below 0.8 with A < 0 -> clipped.
    # Rows 1 and 3 move back toward the trust region: the unclipped term keeps their gradient.
    assert logp.grad[0, 0] == 0 and logp.grad[2, 0] == 0
    torch.testing.assert_close(logp.grad[1, 0], torch.tensor(math.exp(0.5) / 4, dtype=F64))
    torch.testing.assert_close(logp.grad[3, 0], torch.tensor(-math.exp(-0.5) / 4, dtype=F64))
    assert stats["clipped"] == 2


def test_kl_is_zero_when_policy_equals_reference_and_positive_otherwise() -> None:
    logp, _, ref, adv, mask = _inputs(seed=5)
    zero = torch.zeros_like(adv)
    same, s_stats = policy_loss(logp, logp, logp.clone(), zero, mask, "grpo", 0.2, 1.0)
    assert float(same) == 0.0 and float(s_stats["kl_sum"]) == 0.0
    loss, stats = policy_loss(logp, logp, ref, zero, mask, "grpo", 0.2, 1.0)
    assert float(loss) > 0 and float(stats["kl_sum"]) > 0  # k3 >= 0 with equality only at ref == pi


def test_bad_loss_type() -> None:
    logp, old, _, adv, mask = _inputs(seed=6)
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(logp, old, None, adv, mask, "ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logp, old, None, adv, mask, "dr_grpo")
