"""What a decode yields on the host: each row's new tokens chunk by chunk (`TokenChunk`), and
why each row ended ("stop": a stop token; "length": the token budget), kept by `Tracker` from the
steps the device wrote."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass
class TokenChunk:
    """New tokens per row since the previous chunk (none after a row's stop token), and each row's
    reason for ending ("stop" / "length"), None while it is still decoding."""

    tokens: list[list[int]]
    reasons: list[str | None]

    @property
    def finished(self) -> list[bool]:
        return [r is not None for r in self.reasons]


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per row; the stop token included when one ended the row
    finish_reasons: list[str]  # "stop" or "length"
    first_token_s: float  # prefill + first token on the host
    total_s: float


class Tracker:
    """Host-side bookkeeping of each row's tokens and why it finished."""

    def __init__(self, batch: int, stops: Sequence[int], max_new: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.reasons: list[str | None] = [None] * batch
        self.stops, self.max_new, self.steps = set(stops), max_new, 0
        self.last = TokenChunk([], [])  # the most recent chunk

    def add(self, steps: list[list[int]]) -> TokenChunk:
        """Take `steps` (one (B,) list of ids per decode step) -> the chunk of what is new."""
        new: list[list[int]] = [[] for _ in self.tokens]
        for row_tokens in steps:
            for b, tok in enumerate(row_tokens):
                if self.reasons[b] is None:
                    new[b].append(tok)
                    if tok in self.stops:
                        self.reasons[b] = "stop"
        self.steps += len(steps)
        for b, reason in enumerate(self.reasons):
            self.tokens[b] += new[b]
            if reason is None and self.steps >= self.max_new:
                self.reasons[b] = "length"
        self.last = TokenChunk(new, list(self.reasons))
        return self.last

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.reasons)
