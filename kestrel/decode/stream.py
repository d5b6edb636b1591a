"""Streaming text: token ids in, text pieces out, never half a character.

A byte-level tokenizer can split one UTF-8 character (an emoji, a CJK ideograph) over several
tokens; decoding a prefix of them yields U+FFFD. `TextStream` holds such a tail back until the
character completes, and decodes a short window rather than the whole text each time (the
window starts one emitted piece back, so tokenizers that drop a leading space when decoding
a lone token still produce the right text). Concatenating every piece, the final `flush()`
included, gives exactly `tokenizer.decode(all_ids)` with the same options.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from kestrel.decode.tracking import TokenChunk

_INCOMPLETE = "\ufffd"


class TextStream:
    """Incremental detokenizer for one sequence. `push(ids)` -> new text ('' while incomplete)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: one emitted piece back
        self._read = 0  # ids[:_read] are already emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def push(self, ids: Iterable[int]) -> str:
        """Add token ids; return the text they complete (possibly empty)."""
        self.ids.extend(int(i) for i in ids)
        if len(self.ids) == self._read:
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""  # nothing new yet, or a character is still being spelled out in bytes
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Everything not yet emitted, incomplete bytes included (shown as U+FFFD)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


def stream_text(
    chunks: Iterable[TokenChunk], tokenizer, stop_ids: Iterable[int] = (), skip_special_tokens: bool = True
) -> Iterator[list[str]]:
    """Per-row text pieces from a generator's token chunks; stop tokens are left out of the text."""
    stops = set(stop_ids)
    streams: list[TextStream] | None = None
    for chunk in chunks:
        if streams is None:
            streams = [TextStream(tokenizer, skip_special_tokens) for _ in chunk.tokens]
        pieces = [s.push(t for t in toks if t not in stops) for s, toks in zip(streams, chunk.tokens)]
        if any(pieces):
            yield pieces
    if streams is not None:
        tails = [s.flush() for s in streams]
        if any(tails):
            yield tails
