"""Batches: padded rows, or padding-free packed rows.

Packed rows hold several samples back to back; `position_ids` restart at 0 for each sample, and
Hugging Face's mask builder (and our varlen attention path) reads those restarts to keep each
sample's attention inside the sample. The first label of every sample is masked, so no position
learns to predict across a sample boundary.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from kestrel.data.tokenize import IGNORE, Sample
from kestrel.model.attention import STARTS_KWARG, HostStarts, host_starts


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), -100 where no loss
    attention_mask: torch.Tensor | None  # (B, T) for padded batches; None for packed ones
    position_ids: torch.Tensor | None  # (B, T) for packed batches
    tokens: int  # real (non-padding) tokens in the batch
    # Where its samples start, read on the host before the batch moved (`with_starts`), for a model
    # that runs variable-length attention: its forward then reads nothing back from the device.
    starts: HostStarts | None = None

    def to(self, device: torch.device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return dataclasses.replace(self, input_ids=move(self.input_ids), labels=move(self.labels),
                                   attention_mask=move(self.attention_mask), position_ids=move(self.position_ids))

    def with_starts(self) -> "Batch":
        """This (host) batch with its `HostStarts`."""
        return dataclasses.replace(
            self, starts=host_starts(self.attention_mask, self.position_ids, self.input_ids.shape[0]))

    def model_kwargs(self) -> dict[str, HostStarts]:
        """The keywords the model forward takes beside the tensors: the host starts, when the batch has them."""
        return {} if self.starts is None else {STARTS_KWARG: self.starts}


def pad_batch(samples: list[Sample], pad_id: int) -> Batch:
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        labels[i, :n] = torch.tensor(s.labels)
        mask[i, :n] = 1
    return Batch(ids, labels, mask, None, int(mask.sum()))


def bucket_width(n: int) -> int:
    """The smallest m * 2^k >= n with 8 <= m < 16: at most 1/8 more tokens, and the widths of a
    run's batches fall into a few shapes that CUDA graphs replay (8 per doubling of length)."""
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def pack_rows(samples: list[Sample], max_len: int) -> list[list[Sample]]:
    """First-fit-decreasing bin packing of samples into rows of at most `max_len` tokens."""
    rows: list[list[Sample]] = []
    room: list[int] = []
    for s in sorted(samples, key=lambda s: len(s.input_ids), reverse=True):
        n = len(s.input_ids)
        for i, free in enumerate(room):
            if n <= free:
                rows[i].append(s)
                room[i] -= n
                break
        else:
            rows.append([s])
            room.append(max_len - n)
    return rows


def packed_batch(rows: list[list[Sample]], pad_id: int, width: int | None = None) -> Batch:
    """Rows holding samples back to back, `width` wide (default: the longest row)."""
    width = max(width or 0, max(sum(len(s.input_ids) for s in row) for row in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    tokens = 0
    for i, row in enumerate(rows):
        at = 0
        for s in row:
            n = len(s.input_ids)
            ids[i, at : at + n] = torch.tensor(s.input_ids)
            labels[i, at : at + n] = torch.tensor(s.labels)
            labels[i, at] = IGNORE
            positions[i, at : at + n] = torch.arange(n)
            at += n
        tokens += at
        positions[i, at:] = torch.arange(width - at)  # the padding tail is one more "sample"
    return Batch(ids, labels, None, positions, tokens)


class BatchPlan:
    """The order of batches for every epoch, reproducible from the seed (so resume can skip ahead).

    `flat` (the model runs variable-length attention, `kestrel.model.patching.runs_varlen`): an
    unpacked batch becomes one padding-free row of its samples back to back instead of rows
    padded to the longest (the same loss, without the padding's work), and every batch carries
    its sample starts read on the host (`Batch.with_starts`), so the forward does not sync on them. The width of every flat
    or packed batch is rounded up by `bucket_width` (so its shapes repeat for CUDA graphs and
    their chooser), at most to the most a batch can hold: packed rows are nearly full, so that
    costs little. Padded batches keep the longest sample's width, since rounding would add up to
    an eighth more work to every row.
    """

    def __init__(
        self, samples: list[Sample], batch_size: int, packing: bool, max_len: int, pad_id: int, seed: int,
        flat: bool = False,
    ):
        self.units: list[list[Sample]] = pack_rows(samples, max_len) if packing else [[s] for s in samples]
        self.batch_size, self.packing, self.pad_id, self.seed = batch_size, packing, pad_id, seed
        self.max_len, self.flat = max_len, flat

    def __len__(self) -> int:
        return max(1, len(self.units) // self.batch_size)

    def batch(self, epoch: int, index: int) -> Batch:
        order = list(range(len(self.units)))
        random.Random(self.seed + epoch).shuffle(order)
        chosen = [self.units[j] for j in order[index * self.batch_size : (index + 1) * self.batch_size]]
        if not chosen:
            chosen = [self.units[j] for j in order[: self.batch_size]]
        return self._collate(chosen)

    def in_order(self) -> list[Batch]:
        """Every unit exactly once, in order, `batch_size` at a time (the last batch may hold
        fewer): an evaluation pass, collated as training batches are."""
        return [self._collate(self.units[i : i + self.batch_size]) for i in range(0, len(self.units), self.batch_size)]

    def _collate(self, chosen: list[list[Sample]]) -> Batch:
        if self.flat or self.packing:
            rows = chosen if self.packing else [[row[0] for row in chosen]]
            room = self.max_len * (1 if self.packing else self.batch_size)
            used = max(sum(len(s.input_ids) for s in row) for row in rows)
            batch = packed_batch(rows, self.pad_id, max(used, min(bucket_width(used), room)))
        else:
            batch = pad_batch([row[0] for row in chosen], self.pad_id)
        return batch.with_starts() if self.flat else batch
