"""Turning conversations into token ids and loss labels.

The chat template renders each conversation; with `train_on_responses_only` only the assistant
turns (their end-of-turn token included, so the model learns to stop) carry labels, everything
else is -100. The rendered text is tokenized once, with character offsets, and a token is trained
when it starts inside an assistant span.
"""

from __future__ import annotations

import os

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from kestrel.data.formats import Conversation
from kestrel.errors import DatasetError

IGNORE = -100


@dataclass
class Sample:
    """One tokenized sample: `input_ids` and `labels` of equal length (labels unshifted)."""

    input_ids: list[int]
    labels: list[int]
    truncated: bool = False
    line: int = 0

    @property
    def trained_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE)


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    full = _render(tokenizer, messages, False)
    spans = []
    for k, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        # The answer starts where the history plus the generation prompt meets the conversation:
        # a prompt may end in text the rendered conversation lacks (Gemma 4 opens an empty
        # thinking channel), which is the model's prompt, not the answer's first characters.
        start = len(os.path.commonprefix([_render(tokenizer, messages[:k], True), full])) if k else 0
        end = len(_render(tokenizer, messages[: k + 1], False))
        if not full.startswith(_render(tokenizer, messages[: k + 1], False)[:end]):
            # The template rewrites earlier turns once later ones exist; fall back to the content.
            found = full.find(msg["content"], spans[-1][1] if spans else 0)
            start, end = (found, found + len(msg["content"])) if found >= 0 else (start, end)
        spans.append((start, end))
    return full, spans


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, conv: Conversation, max_len: int, responses_only: bool
) -> Sample:
    """Tokenize one conversation, truncating to `max_len` tokens."""
    if conv.text is not None:
        ids = tokenizer(conv.text, add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        labels = list(ids)
    else:
        text, spans = assistant_spans(tokenizer, conv.messages)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        if responses_only:
            labels = [
                tok if any(s <= start < e for s, e in spans) else IGNORE
                for tok, (start, _) in zip(ids, enc["offset_mapping"])
            ]
        else:
            labels = list(ids)
    truncated = len(ids) > max_len
    return Sample(ids[:max_len], labels[:max_len], truncated, conv.line)


@dataclass
class TokenizedDataset:
    samples: list[Sample]
    truncated: int  # rows cut at max_seq_length
    fully_masked: int  # rows left with no trained token (dropped)


def tokenize_all(
    tokenizer: PreTrainedTokenizerBase, convs: list[Conversation], max_len: int, responses_only: bool, source: str = "dataset"
) -> TokenizedDataset:
    """Tokenize every conversation; rows with no trained token are dropped and counted.

    Raises DatasetError when most rows end up fully masked, which means the responses were cut
    off by `max_seq_length` or the chat template hides them.
    """
    samples = [tokenize_conversation(tokenizer, c, max_len, responses_only) for c in convs]
    kept = [s for s in samples if s.trained_tokens > 0]
    masked = len(samples) - len(kept)
    if masked * 2 > len(samples):
        raise DatasetError(
            f"{source}: {masked} of {len(samples)} rows have no trained tokens (every token is prompt "
            f"or was cut at max_seq_length={max_len}). Raise max_seq_length, shorten the prompts, or "
            "set train_on_responses_only: false."
        )
    return TokenizedDataset(kept, sum(s.truncated for s in samples), masked)


MAX_PIECE_TOKENS = 8  # a UTF-8 character is at most 4 bytes; byte-level BPE spends at most one token per byte
_CONTEXT_TOKENS = 4  # tokens decoded before a piece, so a tokenizer that drops a leading space keeps it


def decode_pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[tuple[str, int, int]]:
    """`ids` decoded as text pieces `(text, first, end)`, each covering tokens `ids[first:end]`.

    Most pieces are one token. A character whose bytes are split over several tokens (byte-level
    BPE splits °, ×, emoji and CJK into 2-4 tokens) would decode as U+FFFD one token at a time, so
    its tokens form one piece. Each piece is decoded after a few tokens of context and the
    context's text removed: sentencepiece tokenizers drop the leading space of a lone token.
    """
    pieces: list[tuple[str, int, int]] = []
    start = 0
    for i in range(len(ids)):
        ctx = max(0, start - _CONTEXT_TOKENS)
        before = tokenizer.decode(ids[ctx:start]) if ctx < start else ""
        text = tokenizer.decode(ids[ctx:i + 1])
        last = i + 1 == len(ids) or i + 1 - start >= MAX_PIECE_TOKENS
        if text.endswith("\ufffd") and not last:
            continue  # the character's remaining bytes are in the next tokens
        piece = text[len(before):] if text.startswith(before) else tokenizer.decode(ids[start:i + 1])
        pieces.append((piece, start, i + 1))
        start = i + 1
    return pieces
