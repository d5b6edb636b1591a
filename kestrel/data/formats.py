"""Reading dataset files and recognising their format.

Accepted files: .jsonl, .json, .csv, .parquet (read through `datasets`). Accepted formats, each
turned into one canonical shape, a list of `{"role", "content"}` messages (or plain text):

    messages           {"messages": [{"role": "user", "content": ...}, ...]}
    sharegpt           {"conversations": [{"from": "human", "value": ...}, ...]}
    alpaca             {"instruction": ..., "input": ... (optional), "output": ...}
    prompt_completion  {"prompt": ..., "completion": ...}
    text               {"text": ...}

`columns` in the config renames: e.g. `{"prompt": "question", "completion": "reply"}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kestrel.errors import DatasetError
from kestrel.paths import kestrel_home, resolve_dataset_path

EXTENSIONS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

# format -> the roles it needs (the default column for each role is the role's name)
FORMATS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
OPTIONAL_ROLES = {"alpaca": ("input", "system"), "prompt_completion": ("system",), "messages": (), "sharegpt": (), "text": ()}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system", "bot": "assistant"}


@dataclass
class RowIssue:
    """A row that cannot be used; `line` is 1-based (the line of a .jsonl, the row of a .csv)."""

    line: int
    reason: str


@dataclass
class Conversation:
    """One training sample: messages, or raw text when `text` is set."""

    messages: list[dict[str, str]] = field(default_factory=list)
    text: str | None = None
    line: int = 0


def read_rows(name: str) -> tuple[Path, list[dict[str, Any]]]:
    """All rows of a dataset file (or shipped sample) as dicts."""
    path = resolve_dataset_path(name)
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist (or is not a file); upload it again or pick a sample")
    kind = EXTENSIONS.get(path.suffix.lower())
    if kind is None:
        raise DatasetError(
            f"dataset file {path.name}: unsupported extension {path.suffix!r}; use .jsonl, .json, .csv or .parquet")
    if path.stat().st_size == 0:
        raise DatasetError(f"dataset file {path.name} is empty")
    try:
        from datasets import load_dataset

        cache = kestrel_home() / "cache" / "datasets"
        ds = load_dataset(kind, data_files=str(path), split="train", cache_dir=str(cache))
    except Exception as exc:  # datasets raises many types for malformed files
        raise DatasetError(f"could not read {path.name} as {path.suffix}: {str(exc).splitlines()[0][:300]}") from exc
    rows = ds.to_list()
    if not rows:
        raise DatasetError(f"dataset file {path.name} has no rows")
    return path, rows


def _column(role: str, columns: dict[str, str]) -> str:
    return columns.get(role, role)


def detect_format(rows: list[dict[str, Any]], columns: dict[str, str] | None = None, source: str = "dataset") -> str:
    """The first format whose required columns are all present in the rows."""
    columns = columns or {}
    found = set().union(*(r.keys() for r in rows[:100]))
    for fmt, roles in FORMATS.items():
        if all(_column(role, columns) in found for role in roles):
            return fmt
    accepted = "; ".join(f"{fmt} ({', '.join(roles)})" for fmt, roles in FORMATS.items())
    raise DatasetError(
        f"{source}: no known format matches its columns [{', '.join(sorted(found))}]. Accepted formats "
        f"(required columns): {accepted}. Rename your columns or map them with `columns:` in the config."
    )


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
    path, rows = read_rows(name)
    if fmt == "auto":
        fmt = detect_format(rows, columns, source=path.name)
    elif fmt not in FORMATS:
        raise DatasetError(f"dataset_format {fmt!r} is not known; use auto or one of {', '.join(FORMATS)}")
    good, bad = [], []
    for i, row in enumerate(rows):
        line = i + 2 if path.suffix.lower() == ".csv" else i + 1  # csv line 1 is the header
        try:
            conv = to_conversation(row, fmt, columns, system_prompt)
        except ValueError as exc:
            bad.append(RowIssue(line, str(exc)))
            continue
        conv.line = line
        good.append(conv)
    if not good:
        first = f" (line {bad[0].line}: {bad[0].reason})" if bad else ""
        raise DatasetError(f"{path.name}: none of its {len(rows)} rows is usable as {fmt}{first}")
    return fmt, good, bad
