"""How many rows a max sequence length cuts off, and the length that would fit most of them.

    warning = truncation(lengths, max_len=512)   # None when fewer than TRUNCATION_WARN_SHARE are cut
    truncation_message(warning)  # "⚠️ 40% of rows (400 of 1,000) are longer than max_seq_length=512 ..."

Both the Datasets and the Train tab warn through these two functions, so they say the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

TRUNCATION_WARN_SHARE = 0.05  # warn when at least this share of rows is longer than max_seq_length
FIT_SHARE = 0.95  # the suggested max_seq_length fits this share of rows
MIN_LENGTH_STEP = 16  # suggested lengths are multiples of this at least


@dataclass(frozen=True)
class Truncation:
    """`over` of `rows` rows are longer than `max_len` tokens; `fits` holds FIT_SHARE of them."""

    rows: int
    over: int
    max_len: int
    fits: int

    @property
    def share(self) -> float:
        return self.over / self.rows


def round_up_length(n: int) -> int:
    """`n` rounded up to a length a person would type: steps of 1/8 of its power of two
    (300 -> 320, 1500 -> 1536, 5000 -> 5120), never finer than MIN_LENGTH_STEP."""
    if n <= MIN_LENGTH_STEP:
        return MIN_LENGTH_STEP
    step = max(MIN_LENGTH_STEP, 2 ** (math.floor(math.log2(n)) - 3))
    return math.ceil(n / step) * step


def fit_length(lengths: Sequence[int], share: float = FIT_SHARE) -> int:
    """The smallest rounded length that at least `share` of the rows fit in."""
    ordered = sorted(lengths)
    if not ordered:
        return MIN_LENGTH_STEP
    return round_up_length(ordered[max(0, math.ceil(share * len(ordered)) - 1)])


def truncation(lengths: Sequence[int], max_len: int) -> Truncation | None:
    """The rows (token counts in `lengths`) that `max_len` cuts, when they are at least
    TRUNCATION_WARN_SHARE of all; else None."""
    if not lengths or max_len <= 0:
        return None
    over = sum(1 for n in lengths if n > max_len)
    if over < TRUNCATION_WARN_SHARE * len(lengths):
        return None
    return Truncation(len(lengths), over, max_len, fit_length(lengths))


def truncation_message(t: Truncation) -> str:
    """One markdown line: how many rows are cut, and the max_seq_length that fits FIT_SHARE of them."""
    return (f"⚠️ **{t.share:.0%} of rows ({t.over:,} of {t.rows:,}) are longer than max_seq_length={t.max_len:,}** "
            f"tokens and will be cut off (a cut row may lose its whole answer). max_seq_length={t.fits:,} fits "
            f"{FIT_SHARE:.0%} of them (more tokens cost memory and time).")
