"""The next step's reference pass, queued before this step's metrics are read (DPO and KTO with a
reference scored each step).

Why: at the end of a step the host waits for the step's work, reads its metrics, reports them and
prepares the next step's rows; until the next step's first kernel the GPU has nothing to do. The
reference is the base with the adapter disabled, which the update does not change, so the next
step's first reference pass can be queued before the host waits: the GPU runs it while the host
reports.

    ahead = ahead_for(s)            # None where the reference may change with the update
    ...optimizer step; staged = stage_metrics(...)
    ahead.queue(s, step + 1)        # rows built, reference pass queued; nothing waits
    metrics = staged.read()         # waits for this step's work only
    ...next step: micro_loss takes the queued rows and reference log-probs (`Ahead.take`)

Where it applies: the method needs a reference (`NEEDS_REFERENCE`), it is not precomputed, and
every trainable parameter is an adapter's (`reference_is_frozen`): then the queued log-probs are
exactly the ones the next step would have scored.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kestrel.training.preference.data import micro_batch
from kestrel.training.preference.reference import NEEDS_REFERENCE
from kestrel.training.preference.rows import AnswerRows
from kestrel.training.preference.score import RowSet, reference_logps, scored_rows

ADAPTER_PARTS = ("lora_", "modules_to_save")  # what PEFT's disabled adapter leaves out of the forward


def reference_is_frozen(model: nn.Module) -> bool:
    """Whether every trainable parameter belongs to an adapter that the reference disables."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return bool(names) and all(any(part in name for part in ADAPTER_PARTS) for name in names)


class Ahead:
    """One queued micro-batch: its indices into the training rows, its rows and its (R,) reference
    log-probs, still being computed on the device when queued."""

    def __init__(self) -> None:
        self.samples: list | None = None  # the rows' list (a RowSet is made anew for each use)
        self.idx: list[int] = []
        self.rows: AnswerRows | None = None
        self.ref: torch.Tensor | None = None

    def queue(self, s: Any, step: int) -> None:
        """Score step `step`'s first micro-batch of this rank with the reference (queued, not waited for)."""
        m = step * s.config.grad_accum * s.world.size + s.world.rank
        idx = micro_batch(len(s.samples), s.config.batch_size, s.config.seed, m)
        rows = scored_rows(s, [s.train_rows.samples[i] for i in idx])
        data = s.train_rows
        self.samples, self.idx, self.rows = data.samples, idx, rows
        self.ref = reference_logps(s, data, idx, rows)

    def take(self, data: RowSet, idx: list[int]) -> tuple[AnswerRows, torch.Tensor] | None:
        """The queued rows and reference for micro-batch `idx` of `data`, once; None when another was queued."""
        if self.samples is not data.samples or self.idx != idx or self.rows is None or self.ref is None:
            return None
        out = (self.rows, self.ref)
        self.samples, self.idx, self.rows, self.ref = None, [], None, None
        return out


def ahead_for(s: Any) -> Ahead | None:
    """An `Ahead` for the run where the next reference pass may be queued early, else None."""
    if s.config.method not in NEEDS_REFERENCE or s.train_rows.reference is not None:
        return None
    return Ahead() if reference_is_frozen(s.model) else None
