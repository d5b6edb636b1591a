"""bf16 runs judged against an fp32 run of the same weights: the batches, one run's logits, loss
and LoRA gradients, the relative error, and the MoE routing pin such comparisons need.

A patched bf16 model may not be much further from the fp32 truth than HF's own bf16 model is.
"""

from __future__ import annotations

import torch
from torch import nn

from kestrel.model.registry import family_of
from tests.model.test_patching import VOCAB
from tests.support.routing import pin_routing, routing_of

Batch = dict[str, torch.Tensor]


def padded_batch(device: str = "cpu") -> Batch:
    """(2, 64) right-padded rows of 64 and 37 real tokens (as kestrel.data.collate pads)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 64), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 37:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "labels": labels.to(device), "attention_mask": mask.to(device)}


def packed_batch(long_row: bool, device: str = "cpu") -> Batch:
    """(2, 64) packed rows of samples 40 + 24 and 7 + 30 + 27, or two unpacked 64-token rows."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 64), generator=g)
    labels = ids.clone()
    rows = [[64], [64]] if long_row else [[40, 24], [7, 30, 27]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    labels[positions == 0] = -100  # no sample predicts across a boundary
    return {"input_ids": ids.to(device), "labels": labels.to(device), "position_ids": positions.to(device)}


def run_with_grads(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Logits (fp32), loss, and every LoRA gradient (fp32)."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits.float()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return logits, loss.detach().float(), grads


def rel_err(a: torch.Tensor, truth: torch.Tensor) -> float:
    """max |a - truth| / max |truth|."""
    return float((a - truth).abs().max() / truth.abs().max().clamp(min=1e-6))


def rel_fro(a: torch.Tensor, truth: torch.Tensor) -> float:
    """||a - truth|| / ||truth|| (Frobenius): steadier than `rel_err` from one seed to the next."""
    return float((a - truth).norm() / truth.norm().clamp(min=1e-12))


def pin_to_truth(truth: nn.Module, models: list[nn.Module], batch: Batch) -> None:
    """Route every MoE layer of `models`, and of `truth`'s later runs, as `truth` routes `batch` now
    (see tests.support.routing: a near-tie that bf16 breaks otherwise than fp32 is a routing
    decision, not rounding; the truth is pinned too, so a run with gradients, whose kernels may
    differ, cannot flip one either). No-op for a dense family."""
    spec = family_of(truth.config.model_type)
    if spec is None or spec.moe is None:
        return
    chosen = routing_of(truth, batch)
    for model in [truth, *models]:
        pin_routing(model, chosen)
