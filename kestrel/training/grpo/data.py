"""GRPO prompt datasets: a `prompt` (text or a list of messages) or `messages` column, and an
optional `answer` column that rewards such as `exact_answer` check completions against.

    {"prompt": "What is 3 + 4?", "answer": "7"}
    {"prompt": [{"role": "system", ...}, {"role": "user", ...}], "answer": "7"}
    {"messages": [{"role": "user", ...}, {"role": "assistant", "content": "... The answer is 7."}]}

With `messages`, a final assistant turn is dropped from the prompt and serves as the answer when
there is no `answer` column. Common names are found without a mapping (question, query, ...
for the prompt; solution, target, ... for the answer: `kestrel.data.formats.COLUMN_ALIASES`);
`columns:` in the config names others (`{"prompt": "q"}`). Each
prompt is rendered with the chat template (assistant turn opened) and tokenized once; prompts
longer than `grpo.max_prompt_length` tokens are skipped (truncating a question would make its
answer uncheckable) and counted in the notice.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from kestrel.config import TrainConfig
from kestrel.data.formats import match_columns
from kestrel.data.reader import RowIssue, list_issues, read_table
from kestrel.decode.chat import encode_chat
from kestrel.errors import DatasetError


@dataclass
class PromptRow:
    ids: list[int]  # the rendered prompt's token ids
    text: str  # the last user message, as the rewards see it
    answer: str | None
    line: int


def _messages(row: dict[str, Any], columns: dict[str, str]) -> tuple[list[dict[str, str]], str | None]:
    """(prompt messages, answer taken from a final assistant turn) for one row; ValueError if bad."""
    prompt, messages = row.get(columns.get("prompt", "prompt")), row.get(columns.get("messages", "messages"))
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("empty prompt")
        return [{"role": "user", "content": prompt}], None
    raw = prompt if isinstance(prompt, list) else messages
    if not isinstance(raw, list) or not raw:
        raise ValueError("needs a `prompt` (text or messages) or a `messages` list")
    msgs = []
    for i, m in enumerate(raw):
        ok = isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
        if not ok or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} needs a role (system, user, assistant) and text content")
        msgs.append({"role": m["role"], "content": m["content"]})
    answer = None
    if msgs[-1]["role"] == "assistant":
        answer = msgs.pop()["content"]
    if not any(m["role"] == "user" for m in msgs):
        raise ValueError("has no user message to answer")
    return msgs, answer


def load_prompts(
    config: TrainConfig, tokenizer: Any, needs_answers: bool
) -> tuple[list[PromptRow], list[RowIssue], int]:
    """The usable prompts, the bad rows (line, reason) and how many were too long."""
    table = read_table(config.dataset)
    present = dict.fromkeys(k for r in table.rows[:100] for k in r)
    # question/solution and the like need no mapping; a mapped column stays mapped even when absent
    columns = {**match_columns(present, ("prompt", "answer"), config.columns), **config.columns}
    answer_col = columns.get("answer", "answer")
    good, bad, too_long = [], list(table.issues), 0
    for row, line in zip(table.rows, table.lines):
        try:
            msgs, answer = _messages(row, columns)
        except ValueError as exc:
            bad.append(RowIssue(line, str(exc)))
            continue
        if row.get(answer_col) is not None:
            answer = str(row[answer_col])
        if needs_answers and (answer is None or not answer.strip()):
            bad.append(RowIssue(line, f"no `{answer_col}` to check the completion against"))
            continue
        if config.system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": config.system_prompt})
        ids = encode_chat(tokenizer, msgs)
        if len(ids) > config.grpo.max_prompt_length:
            too_long += 1
            continue
        text = next(m["content"] for m in reversed(msgs) if m["role"] == "user")
        good.append(PromptRow(ids, text, answer, line))
    bad.sort(key=lambda issue: issue.line)
    if not good:
        reason = f" ({list_issues(bad, table.unit)})" if bad else ""
        if too_long and not bad:
            reason = f" (all {too_long} are longer than grpo.max_prompt_length={config.grpo.max_prompt_length} tokens)"
        total = len(table.rows) + len(table.issues)
        raise DatasetError(f"{table.path.name}: none of its {total} rows is a usable GRPO prompt{reason}")
    return good, bad, too_long


@functools.lru_cache(maxsize=4)
def prompt_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    """A fixed shuffle of the prompt indices for each epoch (the same on resume)."""
    order = list(range(n))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return tuple(order)


def prompts_for_step(rows: list[PromptRow], step: int, per_step: int, seed: int) -> list[PromptRow]:
    """The `per_step` prompts of optimizer step `step`: consecutive slots of the epoch shuffles."""
    n = len(rows)
    out = []
    for slot in range(step * per_step, (step + 1) * per_step):
        epoch, k = divmod(slot, n)
        out.append(rows[prompt_order(n, seed, epoch)[k]])
    return out
