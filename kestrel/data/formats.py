"""Reading dataset files and recognising their format.

Accepted files: .jsonl, .json, .csv, .parquet (read by `kestrel.data.reader`, which skips
unreadable lines into the report with their line numbers). Accepted formats, each
turned into one canonical shape, a list of `{"role", "content"}` messages (or plain text):

    messages           {"messages": [{"role": "user", "content": ...}, ...]}
    sharegpt           {"conversations": [{"from": "human", "value": ...}, ...]}
    alpaca             {"instruction": ..., "input": ... (optional), "output": ...}
    prompt_completion  {"prompt": ..., "completion": ...}
    text               {"text": ...}

Common column names are recognised without a mapping (`COLUMN_ALIASES`: question/answer,
input/output, instruction/response, query/reply, ... in any letter case); `columns` in the config
names the column of a role explicitly: e.g. `{"prompt": "q", "completion": "a"}`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kestrel.data.preference import KIND_METHODS, labelled_rows, preference_kind
from kestrel.data.reader import EXTENSIONS, RowIssue, Table, list_issues, read_table
from kestrel.errors import DatasetError

__all__ = ["COLUMN_ALIASES", "EXTENSIONS", "FORMATS", "Conversation", "RowIssue", "Table", "detect", "detect_format",
           "load_conversations", "match_columns", "read_rows", "read_table", "resolve_columns", "to_conversation"]

# format -> the roles it needs (the default column for each role is the role's name)
FORMATS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
OPTIONAL_ROLES = {"alpaca": ("input", "system"), "prompt_completion": ("system",), "messages": (), "sharegpt": (), "text": ()}
# role -> the column names that mean it, in order of preference, matched ignoring case and spaces.
# Detection tries the formats in FORMATS order, so instruction + response is alpaca, input + output
# (no instruction) is prompt_completion; a column serves one role only.
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "conversations": ("conversations",),
    "instruction": ("instruction", "instructions"),
    "input": ("input", "context", "inputs"),
    "output": ("output", "response", "answer", "outputs"),
    "prompt": ("prompt", "question", "query", "input", "instruction", "user", "human", "request", "context"),
    "completion": ("completion", "answer", "response", "output", "reply", "target", "assistant", "gpt",
                   "solution", "result"),
    "system": ("system", "system_prompt"),
    "answer": ("answer", "solution", "target", "output", "completion", "response", "reply"),  # GRPO's reference
    "text": ("text", "content", "document", "body"),
}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system", "bot": "assistant"}


@dataclass
class Conversation:
    """One training sample: messages, or raw text when `text` is set."""

    messages: list[dict[str, str]] = field(default_factory=list)
    text: str | None = None
    line: int = 0


def read_rows(name: str) -> tuple[Path, list[dict[str, Any]]]:
    """The usable rows of a dataset file (or shipped sample) as dicts; see `read_table` for their
    line numbers and the lines that were skipped."""
    table = read_table(name)
    return table.path, table.rows


def _column(role: str, columns: dict[str, str]) -> str:
    return columns.get(role, role)


def _key(name: str) -> str:
    return name.strip().lower().replace(" ", "_").replace("-", "_")


def match_columns(present: Iterable[str], roles: Iterable[str], columns: dict[str, str] | None = None) -> dict[str, str]:
    """role -> column for each of `roles` found among `present`: the explicit mapping in `columns`
    first (a mapped column that is absent finds nothing), then `COLUMN_ALIASES`; a column serves
    one role only."""
    columns = columns or {}
    present = list(present)
    by_key: dict[str, str] = {}
    for name in present:
        by_key.setdefault(_key(name), name)
    used = {c for c in columns.values() if c in present}
    out: dict[str, str] = {}
    for role in roles:
        if role in columns:
            found = columns[role] if columns[role] in present else None
        else:
            found = next((by_key[a] for a in COLUMN_ALIASES.get(role, (role,))
                          if a in by_key and by_key[a] not in used), None)
        if found is not None:
            out[role] = found
            used.add(found)
    return out


def resolve_columns(present: Iterable[str], fmt: str, columns: dict[str, str] | None = None) -> dict[str, str] | None:
    """role -> column for each role of `fmt` (required and optional) found among `present` (see
    `match_columns`); None when a required role has none."""
    found = match_columns(present, FORMATS[fmt] + OPTIONAL_ROLES.get(fmt, ()), columns)
    return found if all(role in found for role in FORMATS[fmt]) else None


def detect(rows: list[dict[str, Any]], columns: dict[str, str] | None = None,
           source: str = "dataset") -> tuple[str, dict[str, str]]:
    """The first format whose required roles all have a column in the rows, and role -> column."""
    found = list(dict.fromkeys(k for r in rows[:100] for k in r))
    kind = preference_kind(set(found), columns or {})
    # KTO rows also have prompt and completion: training on them would teach the undesirable answers too
    unpaired = kind == "unpaired" and labelled_rows(rows, columns or {})
    for fmt in FORMATS if not unpaired else ():
        resolved = resolve_columns(found, fmt, columns)
        if resolved is not None:
            return fmt, resolved
    if kind:  # the right data for another method: say which, not "no known format"
        raise DatasetError(f"{source}: its columns [{', '.join(sorted(found))}] hold {kind} preference rows, which "
                           f"method {KIND_METHODS[kind]} trains, not conversations for supervised fine-tuning. "
                           "Choose that method, or a dataset of conversations for this one.")
    accepted = "; ".join(f"{fmt} ({', '.join(roles)})" for fmt, roles in FORMATS.items())
    raise DatasetError(
        f"{source}: no known format matches its columns [{', '.join(sorted(found))}]. Accepted formats "
        f"(required columns): {accepted}. Rename your columns or map them with `columns:` in the config "
        "(the studio's Datasets tab saves a mapping with the dataset)."
    )


def detect_format(rows: list[dict[str, Any]], columns: dict[str, str] | None = None, source: str = "dataset") -> str:
    """The first format whose required columns are all present in the rows (see `detect`)."""
    return detect(rows, columns, source)[0]


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def _convert_messages(raw: Any, role_key: str, content_key: str, role_map: dict[str, str] | None) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise ValueError("needs a non-empty list of messages")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or role_key not in msg or content_key not in msg:
            raise ValueError(f"message {i} needs `{role_key}` and `{content_key}`")
        role = str(msg[role_key]).lower()
        role = role_map.get(role, "") if role_map is not None else role
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"message {i} has role {msg[role_key]!r}; use system, user or assistant")
        if not isinstance(msg[content_key], str):
            raise ValueError(f"message {i} content is not text")
        out.append({"role": role, "content": msg[content_key]})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("has no assistant message to learn from")
    return out


def to_conversation(row: dict[str, Any], fmt: str, columns: dict[str, str], system_prompt: str | None) -> Conversation:
    """One row in canonical form; raises ValueError with the reason for a bad row."""
    col = lambda role: row.get(_column(role, columns))  # noqa: E731
    if fmt == "text":
        text = _text(col("text"))
        if text is None:
            raise ValueError("empty text")
        return Conversation(text=text)
    if fmt == "messages":
        msgs = _convert_messages(col("messages"), "role", "content", None)
    elif fmt == "sharegpt":
        msgs = _convert_messages(col("conversations"), "from", "value", SHAREGPT_ROLES)
    else:
        if fmt == "alpaca":
            prompt, answer = _text(col("instruction")), col("output")
            extra = _text(col("input"))
            prompt = f"{prompt}\n\n{extra}" if prompt and extra else prompt
        else:
            prompt, answer = _text(col("prompt")), col("completion")
        if prompt is None:
            raise ValueError("empty prompt" if fmt == "prompt_completion" else "empty instruction")
        if not isinstance(answer, str) or not answer.strip():
            raise ValueError("empty completion" if fmt == "prompt_completion" else "empty output")
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        system = _text(col("system"))
        if system:
            msgs.insert(0, {"role": "system", "content": system})
    if system_prompt and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return Conversation(messages=msgs)


def load_conversations(
    name: str, fmt: str = "auto", columns: dict[str, str] | None = None, system_prompt: str | None = None
) -> tuple[str, list[Conversation], list[RowIssue]]:
    """Read a dataset: (format, good rows, bad rows with their line numbers and why)."""
    columns = columns or {}
    table = read_table(name)
    if fmt == "auto":
        fmt, columns = detect(table.rows, columns, source=table.path.name)
    elif fmt not in FORMATS:
        raise DatasetError(f"dataset_format {fmt!r} is not known; use auto or one of {', '.join(FORMATS)}")
    else:  # a named format still finds its columns under their common names
        present = dict.fromkeys(k for r in table.rows[:100] for k in r)
        columns = resolve_columns(present, fmt, columns) or columns
    good, bad = [], list(table.issues)
    for row, line in zip(table.rows, table.lines):
        try:
            conv = to_conversation(row, fmt, columns, system_prompt)
        except ValueError as exc:
            bad.append(RowIssue(line, str(exc)))
            continue
        conv.line = line
        good.append(conv)
    bad.sort(key=lambda issue: issue.line)
    if not good:
        total = len(table.rows) + len(table.issues)
        raise DatasetError(f"{table.path.name}: none of its {total} rows is usable as {fmt} "
                           f"({list_issues(bad, table.unit)})")
    return fmt, good, bad
