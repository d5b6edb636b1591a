"""Each preference loss equals TRL 1.16's on the same batch (CPU, fp64 inputs, tight tolerance):
DPO and KTO through the trainers' own `_compute_loss` (a stand-in model hands them fixed
per-token log-probs), ORPO's odds ratio and SimPO through `ORPOTrainer.odds_ratio_loss` and
`CPOTrainer.cpo_loss`."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from kestrel.constants import DPO_LOSS_TYPES, SMOOTHED_LOSS_TYPES
from kestrel.training.preference.loss import dpo_loss, kto_kl, kto_loss, orpo_loss, simpo_loss

trl = pytest.importorskip("trl")
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402
from trl.experimental.cpo.cpo_trainer import CPOTrainer  # noqa: E402
from trl.experimental.orpo.orpo_trainer import ORPOTrainer  # noqa: E402

P, T = 5, 9  # pairs, tokens per row
TOL = dict(rtol=1e-10, atol=1e-12)


def _accelerator() -> SimpleNamespace:
    same = lambda x: x  # noqa: E731 - one process: gathering is the identity
    return SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=same, gather=same, unwrap_model=same)


def _trainer(**fields) -> SimpleNamespace:
    """What TRL's `_compute_loss` reads of `self`, for one process with precomputed references."""
    return SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False,
                           precompute_ref_logps=True, _metrics=defaultdict(lambda: defaultdict(list)),
                           _total_train_tokens=0, _tp_size=1, args=SimpleNamespace(), **fields)


def _rows(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (rows, T - 1), 0 outside each row's answer, and the answer mask (rows, T)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T - 2, (rows,), generator=g)
    mask = torch.zeros(rows, T, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        mask[i, T - n:] = 1  # answers at the end, prompts before
    logps = -torch.rand(rows, T - 1, generator=g, dtype=torch.float64) * 3 * mask[:, 1:]
    return logps, mask


def _model(by_ids: dict[int, torch.Tensor]):
    """A stand-in for TRL's fused-head forward: the given per-token log-probs for those input_ids."""
    def forward(input_ids, labels=None, **_):
        lp = by_ids[id(input_ids)]
        zeros = torch.zeros_like(lp)
        return SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    return forward


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_matches_trl(loss_type: str) -> None:
    logps, mask = _rows(2 * P, seed=0)  # [chosen; rejected] along the batch, as both lay them out
    ref = -torch.rand(2 * P, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 10
    ids = torch.zeros(2 * P, T, dtype=torch.long)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask,
              "ref_chosen_logps": ref[:P], "ref_rejected_logps": ref[P:]}
    beta, smoothing = 0.3, (0.1 if loss_type in SMOOTHED_LOSS_TYPES else 0.0)
    them = _trainer(beta=beta, loss_types=[loss_type], loss_weights=[1.0], ld_alpha=None, label_smoothing=smoothing,
                    f_divergence_type="reverse_kl", use_weighting=False)
    expected = DPOTrainer._compute_loss(them, _model({id(ids): logps}), inputs, False)
    seq, tokens = logps.sum(1), mask.sum(1).double()
    ours = dpo_loss(seq[:P], seq[P:], ref[:P], ref[P:], beta, loss_type, tokens[:P], tokens[P:], smoothing)
    # TRL takes exo_pair's log(1 - e) and log(e) of a float32 tensor: its loss is float32-exact only
    tol = dict(rtol=1e-7, atol=1e-7) if loss_type == "exo_pair" else TOL
    torch.testing.assert_close(ours.loss, expected, **tol)
    metrics = {k: v[-1] for k, v in them._metrics["train"].items()}
    margins = ours.chosen_rewards - ours.rejected_rewards
    assert ours.chosen_rewards.mean().item() == pytest.approx(metrics["rewards/chosen"], rel=1e-12)
    assert ours.rejected_rewards.mean().item() == pytest.approx(metrics["rewards/rejected"], rel=1e-12)
    assert margins.mean().item() == pytest.approx(metrics["rewards/margins"], rel=1e-12)
    assert (margins > 0).double().mean().item() == pytest.approx(metrics["rewards/accuracies"])


def test_kto_matches_trl() -> None:
    n = 6
    logps, mask = _rows(n, seed=2)
    kl_logps, kl_mask = _rows(n, seed=3)
    g = torch.Generator().manual_seed(4)
    ref, ref_kl = -torch.rand(n, generator=g, dtype=torch.float64) * 10, -torch.rand(n, generator=g, dtype=torch.float64) * 5
    labels = torch.tensor([True, False, True, True, False, False])
    ids, kl_ids = torch.zeros(n, T, dtype=torch.long), torch.ones(n, T, dtype=torch.long)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask,
              "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones_like(kl_ids), "KL_completion_mask": kl_mask,
              "label": labels, "ref_logps": ref, "ref_KL_logps": ref_kl}
    beta, wd, wu = 0.2, 1.3, 0.7
    them = _trainer(beta=beta, loss_type="kto", calculate_KL=True, desirable_weight=wd, undesirable_weight=wu)
    them._compute_kl_logps = lambda model, batch: KTOTrainer._compute_kl_logps(them, model, batch)
    # The KL rows' log-probs exceed the reference's, so the clamp at 0 does not hide the term.
    kl_logps = kl_logps + (ref_kl - kl_logps.sum(1) + 1.5)[:, None] / (T - 1)
    expected = KTOTrainer._compute_loss(them, _model({id(ids): logps, id(kl_ids): kl_logps}), inputs, False)
    kl = kto_kl(kl_logps.sum(1), ref_kl)
    assert kl.item() > 1.0
    ours = kto_loss(logps.sum(1), ref, labels, kl, beta, wd, wu)
    torch.testing.assert_close(ours.loss, expected, **TOL)
    metrics = {k: v[-1] for k, v in them._metrics["train"].items()}
    assert ours.kl.item() == pytest.approx(metrics["kl"], rel=1e-12)
    assert ours.rewards[labels].mean().item() == pytest.approx(metrics["rewards/chosen"], rel=1e-12)
    assert ours.rewards[~labels].mean().item() == pytest.approx(metrics["rewards/rejected"], rel=1e-12)


def _means(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c, r = -torch.rand(P, generator=g, dtype=torch.float64) * 2, -torch.rand(P, generator=g, dtype=torch.float64) * 2
    return c, r, torch.rand((), generator=g, dtype=torch.float64)


def test_orpo_matches_trl() -> None:
    c, r, nll = _means(5)
    beta = 0.25
    them = SimpleNamespace(beta=beta, accelerator=_accelerator())
    losses, chosen_rewards, rejected_rewards, ratio, log_odds = ORPOTrainer.odds_ratio_loss(them, c, r)
    ours = orpo_loss(c, r, nll, beta)
    torch.testing.assert_close(ours.loss, nll - losses.mean(), **TOL)  # TRL: policy_nll_loss - losses.mean()
    torch.testing.assert_close(ours.chosen_rewards, chosen_rewards, **TOL)
    torch.testing.assert_close(ours.rejected_rewards, rejected_rewards, **TOL)
    torch.testing.assert_close(ours.extra["log_odds_ratio"], ratio, **TOL)
    torch.testing.assert_close(ours.extra["log_odds_chosen"], log_odds, **TOL)


@pytest.mark.parametrize("cpo_alpha", [0.0, 0.5])
def test_simpo_matches_trl(cpo_alpha: float) -> None:
    c, r, nll = _means(6)
    beta, gamma = 2.0, 0.8
    them = SimpleNamespace(beta=beta, alpha=0.0, loss_type="simpo", simpo_gamma=gamma, label_smoothing=0.0,
                           accelerator=_accelerator())
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(them, c, r)
    ours = simpo_loss(c, r, nll, beta, gamma, cpo_alpha)
    torch.testing.assert_close(ours.loss, losses.mean() + cpo_alpha * nll, **TOL)  # TRL: + cpo_alpha * nll
    torch.testing.assert_close(ours.chosen_rewards, chosen_rewards, **TOL)
    torch.testing.assert_close(ours.rejected_rewards, rejected_rewards, **TOL)
