"""Preference rows -> token ids: the prompt rendered with the chat template (assistant turn
opened) and each answer as the text the template adds after it (its end-of-turn included, so the
model learns to stop). Only answer tokens are scored; the prompt is context.

    samples, report = tokenize_preferences(tokenizer, data.rows, max_len=1024)
    samples[0].prompt, samples[0].answers   # [chosen ids, rejected ids] (paired) or [completion ids]

Rows longer than `max_len` keep their prompt and lose the end of the answer (counted); a prompt
that leaves no room for an answer skips its row (reported with its line).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kestrel.data.preference import Messages, PreferenceRow
from kestrel.data.reader import RowIssue


@dataclass
class PreferenceSample:
    prompt: list[int]
    answers: list[list[int]]  # paired: [chosen, rejected]; unpaired: [completion]
    label: bool | None = None  # unpaired: desirable
    line: int = 0


@dataclass
class TokenReport:
    truncated: int = 0  # rows whose answer lost its end at max_len
    skipped: list[RowIssue] = field(default_factory=list)  # prompts too long for any answer


def _render(tokenizer: Any, messages: Messages, open_turn: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=open_turn)


def answer_text(tokenizer: Any, prompt: Messages, answer: Messages, prompt_text: str) -> str:
    """What the chat template appends to `prompt_text` for `answer` (its end-of-turn markers
    included). A template that rewrites earlier turns once later ones exist gets the answer's
    content and the end-of-sequence token instead."""
    full = _render(tokenizer, prompt + answer, False)
    if full.startswith(prompt_text) and len(full) > len(prompt_text):
        return full[len(prompt_text):]
    return "".join(m["content"] for m in answer) + (tokenizer.eos_token or "")


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_preferences(
    tokenizer: Any, rows: list[PreferenceRow], max_len: int
) -> tuple[list[PreferenceSample], TokenReport]:
    """Token ids of every row (see the module docstring); answers cut so prompt + answer fits."""
    samples, report = [], TokenReport()
    for row in rows:
        prompt_text = _render(tokenizer, row.prompt, True)
        prompt = _ids(tokenizer, prompt_text)
        room = max_len - len(prompt)
        if room < 1:
            report.skipped.append(RowIssue(row.line, f"the prompt is {len(prompt)} tokens, which leaves no room for "
                                                     f"an answer within max_seq_length={max_len}"))
            continue
        answers = [row.chosen] + ([row.rejected] if row.rejected is not None else [])
        ids = [_ids(tokenizer, answer_text(tokenizer, row.prompt, a, prompt_text)) for a in answers]
        if any(len(a) > room for a in ids):
            report.truncated += 1
        samples.append(PreferenceSample(prompt, [a[:room] for a in ids], row.label, row.line))
    return samples, report
