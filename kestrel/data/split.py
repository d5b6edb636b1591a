"""Holding rows out of a training file for evaluation: a seeded choice at the row level, made
before tokenizing and packing, so no packed row ever mixes training and eval samples.

    train, held_out = split_rows(conversations, fraction=0.05, seed=42)
"""

from __future__ import annotations

import random
from typing import Sequence, TypeVar

from kestrel.errors import DatasetError

T = TypeVar("T")
SPLIT_SALT = 0x5EED_E7A1  # the split's own random stream: the batch order's seed never moves it


def held_out_count(n: int, fraction: float) -> int:
    """round(n * fraction), at least one row (and at least one left to train on)."""
    return min(n - 1, max(1, round(n * fraction)))


def split_rows(items: Sequence[T], fraction: float, seed: int, source: str = "dataset") -> tuple[list[T], list[T]]:
    """(train, held out): `held_out_count` items picked by a shuffle seeded with `seed`; each
    part keeps the file's order. The same items, seed and fraction give the same split."""
    n = len(items)
    if n < 2:
        raise DatasetError(f"{source}: eval_split needs at least 2 usable rows to hold some out, it has {n}; "
                           "add rows or give a separate eval_dataset")
    order = list(range(n))
    random.Random(seed ^ SPLIT_SALT).shuffle(order)
    chosen = set(order[: held_out_count(n, fraction)])
    return [x for i, x in enumerate(items) if i not in chosen], [x for i, x in enumerate(items) if i in chosen]
