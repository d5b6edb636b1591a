"""Preference datasets: paired rows (DPO, ORPO, SimPO) and unpaired labelled rows (KTO), read
into messages, with a per-row report of what was skipped and why.

Paired layouts (columns `prompt` (optional for full conversations), `chosen`, `rejected`):

    text           {"prompt": "Q", "chosen": "good answer", "rejected": "bad answer"}
    messages       {"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant", ...}], "rejected": [...]}
    conversation   UltraFeedback-style: chosen and rejected are whole conversations that share
                   everything up to their last assistant turn, which is the prompt
                   {"prompt": "Q", "chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", ...}], ...}
    transcript     Anthropic HH-style: chosen and rejected are "\\n\\nHuman: ... \\n\\nAssistant: ..."
                   texts; the turns they share (up to the last Assistant turn) are the prompt

Unpaired (KTO, columns `prompt`, `completion`, `label`): the completion as text or assistant
messages, the label true (desirable) / false (undesirable), also written 1 / 0 or "true" / "false".

    pairs = load_preferences(config.dataset, kind="paired", columns=config.columns)
    pairs.rows[0].prompt, pairs.rows[0].chosen, pairs.rows[0].rejected   # lists of messages

`columns:` in the config renames (`{"chosen": "better", "rejected": "worse"}`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kestrel.data.reader import RowIssue, list_issues, read_table
from kestrel.errors import DatasetError

Messages = list[dict[str, str]]
PAIRED_ROLES = ("chosen", "rejected")  # `prompt` is optional: full conversations carry it
UNPAIRED_ROLES = ("prompt", "completion", "label")
KIND_METHODS = {"paired": "dpo, orpo or simpo", "unpaired": "kto"}  # which methods train each kind
ROLES = ("system", "user", "assistant")
_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant):[ \t]?")  # Anthropic HH's turn markers
_TRUE, _FALSE = ("true", "1", "yes", "desirable"), ("false", "0", "no", "undesirable")


@dataclass
class PreferenceRow:
    """One training row: the prompt's messages and one (unpaired) or two (paired) answers, each a
    list of messages that follows the prompt (usually one assistant turn)."""

    prompt: Messages
    chosen: Messages  # unpaired: the completion
    rejected: Messages | None = None  # paired only
    label: bool | None = None  # unpaired only: True when desirable
    layout: str = ""
    line: int = 0


@dataclass
class PreferenceData:
    kind: str  # paired | unpaired
    layout: str  # the layout of the first usable row (see the module docstring)
    rows: list[PreferenceRow] = field(default_factory=list)
    bad: list[RowIssue] = field(default_factory=list)


def preference_kind(found: set[str], columns: dict[str, str]) -> str | None:
    """`paired` when the columns hold chosen and rejected, `unpaired` for prompt, completion and
    label, else None."""
    col = lambda role: columns.get(role, role)  # noqa: E731
    if all(col(r) in found for r in PAIRED_ROLES):
        return "paired"
    if all(col(r) in found for r in UNPAIRED_ROLES):
        return "unpaired"
    return None


def _messages(raw: Any, what: str) -> Messages:
    """A list of {"role", "content"} messages (role system, user or assistant; text content)."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{what} needs text or a non-empty list of messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{what} message {i} needs a role (system, user, assistant) and text content")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _transcript(text: str, what: str) -> Messages:
    """An HH transcript ("\\n\\nHuman: hi\\n\\nAssistant: hello") as messages."""
    parts = _TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise ValueError(f"{what} is not a Human:/Assistant: transcript")
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[who], "content": body.strip()} for who, body in zip(parts[1::2], parts[2::2])]


def _is_transcript(value: Any) -> bool:
    return isinstance(value, str) and bool(re.match(r"\s*Human:", value)) and "\n\nAssistant:" in value


def _answer(value: Any, what: str) -> Messages:
    """A completion: text (one assistant turn) or messages."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"empty {what}")
        return [{"role": "assistant", "content": value}]
    return _messages(value, what)


def _prompt(value: Any) -> Messages:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("empty prompt")
        return [{"role": "user", "content": value}]
    msgs = _messages(value, "prompt")
    if not any(m["role"] == "user" for m in msgs):
        raise ValueError("prompt has no user message")
    return msgs


def _split_shared(chosen: Messages, rejected: Messages) -> tuple[Messages, Messages, Messages]:
    """Whole conversations -> (shared prompt, chosen answer, rejected answer): each answer is its
    conversation's last assistant turn, and everything before it must be the same in both."""
    for msgs, what in ((chosen, "chosen"), (rejected, "rejected")):
        if msgs[-1]["role"] != "assistant":
            raise ValueError(f"{what} does not end with an assistant turn")
    if chosen[:-1] != rejected[:-1]:
        raise ValueError("chosen and rejected differ before their last assistant turn; they must share the "
                         "conversation up to the answer")
    if not any(m["role"] == "user" for m in chosen[:-1]):
        raise ValueError("chosen and rejected have no user turn before the answer")
    return chosen[:-1], chosen[-1:], rejected[-1:]


def paired_row(row: dict[str, Any], columns: dict[str, str]) -> PreferenceRow:
    """One paired row in any layout; ValueError with the reason for a bad one."""
    col = lambda role: row.get(columns.get(role, role))  # noqa: E731
    prompt, chosen, rejected = col("prompt"), col("chosen"), col("rejected")
    for role, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            raise ValueError(f"no `{columns.get(role, role)}`")
    if _is_transcript(chosen) and _is_transcript(rejected):
        p, c, r = _split_shared(_transcript(chosen, "chosen"), _transcript(rejected, "rejected"))
        return PreferenceRow(p, c, r, layout="transcript")
    whole = [isinstance(v, list) and any(isinstance(m, dict) and m.get("role") == "user" for m in v)
             for v in (chosen, rejected)]
    if all(whole):
        p, c, r = _split_shared(_messages(chosen, "chosen"), _messages(rejected, "rejected"))
        return PreferenceRow(p, c, r, layout="conversation")
    if any(whole):
        raise ValueError("one of chosen and rejected is a whole conversation and the other only an answer")
    if prompt is None:
        raise ValueError(f"no `{columns.get('prompt', 'prompt')}`: answers alone need the prompt they answer")
    c, r = _answer(chosen, "chosen"), _answer(rejected, "rejected")
    if c == r:
        raise ValueError("chosen and rejected are the same answer")
    layout = "text" if isinstance(chosen, str) else "messages"
    return PreferenceRow(_prompt(prompt), c, r, layout=layout)


def _label(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"label must be true or false (or 1 / 0), got {str(value)[:40]!r}")


def labelled_rows(rows: list[dict[str, Any]], columns: dict[str, str]) -> bool:
    """Whether `rows` carry KTO's true/false label (not just any column named label)."""
    column = columns.get("label", "label")
    labels = [r[column] for r in rows[:100] if column in r]
    try:
        for value in labels:
            _label(value)  # raises on anything but true / false (or 1 / 0)
    except ValueError:
        return False
    return bool(labels)


def unpaired_row(row: dict[str, Any], columns: dict[str, str]) -> PreferenceRow:
    """One KTO row; ValueError with the reason for a bad one."""
    col = lambda role: row.get(columns.get(role, role))  # noqa: E731
    label = _label(col("label"))
    prompt, completion = col("prompt"), col("completion")
    if prompt is None:
        raise ValueError(f"no `{columns.get('prompt', 'prompt')}`")
    layout = "text" if isinstance(completion, str) else "messages"
    return PreferenceRow(_prompt(prompt), _answer(completion, "completion"), None, label, layout)


def load_preferences(
    name: str, kind: str, columns: dict[str, str] | None = None, system_prompt: str | None = None
) -> PreferenceData:
    """Read a preference dataset of `kind` (paired | unpaired): the usable rows and the bad ones
    (line, why). DatasetError when the columns do not fit `kind` or no row is usable."""
    columns = columns or {}
    table = read_table(name)
    found = set().union(*(r.keys() for r in table.rows[:100])) if table.rows else set()
    have = preference_kind(found, columns)
    if have != kind:
        need = PAIRED_ROLES if kind == "paired" else UNPAIRED_ROLES
        other = ("; it looks like unpaired KTO data (prompt, completion, label): use method kto" if have == "unpaired"
                 else "; it looks like paired data (chosen, rejected): use method dpo, orpo or simpo" if have else "")
        raise DatasetError(
            f"{table.path.name}: {kind} preference data needs the columns {', '.join(need)}"
            f"{' (and prompt, unless chosen and rejected are whole conversations)' if kind == 'paired' else ''}; "
            f"it has [{', '.join(sorted(found))}]{other}. Map other names with `columns:` in the config.")
    convert = paired_row if kind == "paired" else unpaired_row
    data = PreferenceData(kind, "", bad=list(table.issues))
    for row, line in zip(table.rows, table.lines):
        try:
            item = convert(row, columns)
        except ValueError as exc:
            data.bad.append(RowIssue(line, str(exc)))
            continue
        if system_prompt and item.prompt[0]["role"] != "system":
            item.prompt.insert(0, {"role": "system", "content": system_prompt})
        item.line = line
        data.rows.append(item)
    data.bad.sort(key=lambda issue: issue.line)
    if not data.rows:
        total = len(table.rows) + len(table.issues)
        raise DatasetError(f"{table.path.name}: none of its {total} rows is usable {kind} preference data "
                           f"({list_issues(data.bad, table.unit)})")
    data.layout = data.rows[0].layout
    return data
