"""Turning conversations into token ids and loss labels.

The chat template renders each conversation; with `train_on_responses_only` only the assistant
turns (their end-of-turn token included, so the model learns to stop) carry labels, everything
else is -100. The rendered text is tokenized once, with character offsets, and a token is trained
when it starts inside an assistant span.
"""

from __future__ import annotations

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
        start = len(_render(tokenizer, messages[:k], True)) if k else 0
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
