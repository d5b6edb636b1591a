"""The reference policy of DPO and KTO: the base model with the adapter disabled (no second copy
of the weights), either scored with each step's rows or precomputed once for the whole dataset.

Full fine-tuning has no adapter to disable, so its reference log-probs are always precomputed
before the first update (and before a resumed run loads its trained weights), from the weights as
loaded: no frozen copy of the model is kept.

    with as_reference(model):
        ref = answer_logprobs(model, rows).sum(-1)
    table = precompute(model, samples, pad_id, device, flat, batch_rows, partner)   # RefTable
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from kestrel.data.preference_tokens import PreferenceSample
from kestrel.recompute.checkpoint import Recompute
from kestrel.recompute.no_grad import no_grad_forwards
from kestrel.training.distributed import World, reshard_after_scoring
from kestrel.training.preference.rows import answer_logprobs, answer_rows

NEEDS_REFERENCE = ("dpo", "kto")


@contextlib.contextmanager
def as_reference(
    model: nn.Module, layers: Sequence[nn.Module] | None = None, recompute: Recompute | None = None,
) -> Iterator[None]:
    """No gradient, eval mode (no dropout, no checkpointing), adapters disabled when there are any;
    with the run's `recompute`, the decoder layers replay CUDA graphs where the run graphs this
    batch layout (`kestrel.recompute.no_grad`).

    The adapters are switched as PEFT's `disable_adapter()` switches them (each tuner layer's
    `enable_adapters`, which also stops A and B from needing a gradient), on `layers` (a run finds
    them once, `adapter_layers`, and passes them at every step; found here when not given), and
    only those enabled before are enabled again after: PEFT's context walks every module and takes
    the model's adapter status each time, host work at the start of every step while the GPU waits."""
    was_training = model.training
    switched = [layer for layer in (adapter_layers(model) if layers is None else layers) if not layer.disable_adapters]
    model.eval()
    try:
        with torch.no_grad():
            for layer in switched:
                layer.enable_adapters(False)
            try:
                with no_grad_forwards(recompute):
                    yield
            finally:
                for layer in switched:
                    layer.enable_adapters(True)
    finally:
        model.train(was_training)


def adapter_layers(model: nn.Module) -> list[nn.Module]:
    """The modules PEFT switches to disable its adapters (LoRA layers, `modules_to_save` wrappers);
    none for a model without PEFT adapters. A walk over every module: a run does it once."""
    if not hasattr(model, "disable_adapter"):
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]


@dataclass
class RefTable:
    """Precomputed reference sequence log-probs: `answers` (n, A) for each sample's A answers
    (chosen, rejected; or the KTO completion), `kl` (n,) KTO's mismatched rows (else None)."""

    answers: torch.Tensor
    kl: torch.Tensor | None = None


def sequence_logps(model: nn.Module, pairs: list[tuple[list[int], list[int]]], pad_id: int,
                   device: torch.device, flat: bool) -> torch.Tensor:
    """(R,) summed answer log-probs of (prompt, answer) rows, under the model's current state."""
    return answer_logprobs(model, answer_rows(pairs, pad_id, device, flat)).sum(-1)


def precompute(
    model: nn.Module, samples: list[PreferenceSample], pad_id: int, device: torch.device, flat: bool,
    batch_rows: int, partner: list[int] | None = None, world: World | None = None,
) -> RefTable:
    """Reference log-probs of every answer of every sample (and of KTO's mismatched rows when
    `partner` is given), `batch_rows` rows per forward, kept on the device (a few floats a row).

    On several devices (`world`) rank r scores forwards r, r + N, ... into a zero table that one
    all-reduce completes on every rank. Every rank runs the same number of forwards (a rank past
    the last one scores it again and drops it): a forward of an FSDP2-sharded model is a collective."""
    world = world or World()
    answers = len(samples[0].answers)
    rows = [(s.prompt, a) for s in samples for a in s.answers]  # sample-major: row i*A + k
    if partner is not None:
        rows += [(s.prompt, samples[partner[i]].answers[0]) for i, s in enumerate(samples)]
    starts = list(range(0, len(rows), batch_rows))
    logps = torch.zeros(len(rows), device=device)
    with as_reference(model):
        for k in range(world.rank, math.ceil(len(starts) / world.size) * world.size, world.size):
            lo = starts[min(k, len(starts) - 1)]
            scored = sequence_logps(model, rows[lo : lo + batch_rows], pad_id, device, flat).float()
            if k < len(starts):
                logps[lo : lo + len(scored)] = scored
    reshard_after_scoring(model)
    world.sum(logps)
    n = len(samples)
    table = logps[: n * answers].view(n, answers)
    return RefTable(table, logps[n * answers :] if partner is not None else None)
