"""Datasets tab, preference data: a file whose columns are `chosen` / `rejected` (DPO, ORPO, SimPO)
or `prompt` / `completion` / `label` (KTO) is recognised before the SFT formats and previewed
with its answers side by side; its token view shows the prompt (masked: context only) and each
answer (scored).

    kind = preference_kind_of(present_columns, columns)      # "paired" | "unpaired" | None
    out = preference_view(state, table_rows, model)          # the tab's outputs for that file
    out = preference_tokens(state, line, model, max_len)     # {"tokens", "token_summary"}

The tab's state gets `preference: <kind>` and keeps `format: auto` (a preference run ignores
`dataset_format`, which names SFT layouts).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from kestrel.errors import DatasetError, KestrelError
from kestrel.studio import strings as S
from kestrel.studio.handlers.common import tokenizer_for

PREVIEW_ROWS = 10
HIST_ROWS = 2000
MAX_CELL = 300


def preference_kind_of(present: list[str], columns: dict[str, str]) -> str | None:
    from kestrel.data.preference import preference_kind

    return preference_kind(set(present), columns)


@functools.lru_cache(maxsize=4)
def _load(path: str, _mtime: float, kind: str, columns: tuple[tuple[str, str], ...]) -> Any:
    from kestrel.data.preference import load_preferences

    return load_preferences(path, kind, dict(columns))


def load(state: dict[str, Any]) -> Any:
    """The `PreferenceData` of the file in `state` (cached per file version)."""
    p = Path(state["path"])
    if not p.is_file():
        raise DatasetError(S.ERR_DATASET_MISSING.format(path=state["path"]))
    return _load(str(p), p.stat().st_mtime, state["preference"], tuple(sorted((state.get("columns") or {}).items())))


def _said(messages: list[dict[str, str]]) -> str:
    """Messages as one cell: the content alone for a single turn, else `role: content` lines."""
    text = messages[0]["content"] if len(messages) == 1 else "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    return text if len(text) <= MAX_CELL else text[:MAX_CELL] + "…"


def side_by_side(rows: list[Any]) -> pd.DataFrame:
    """The first rows as line | prompt | chosen | rejected (KTO: line | prompt | completion | label)."""
    head = rows[:PREVIEW_ROWS]
    if head and head[0].rejected is None:
        return pd.DataFrame([[r.line, _said(r.prompt), _said(r.chosen), S.DS_KTO_LABELS[bool(r.label)]] for r in head],
                            columns=["line", "prompt", "completion", "label"])
    return pd.DataFrame([[r.line, _said(r.prompt), _said(r.chosen), _said(r.rejected)] for r in head],
                        columns=["line", "prompt", "chosen", "rejected"])


def _lengths(rows: list[Any], model: str) -> tuple[list[int], str]:
    """Tokens of prompt + longest answer per row (what one row of a training forward holds)."""
    from kestrel.data.preference_tokens import tokenize_preferences

    try:
        samples, _ = tokenize_preferences(tokenizer_for(model), rows[:HIST_ROWS], 1 << 30)
    except KestrelError as exc:
        return [], S.ERR_NO_TOKEN_COUNTS.format(error=exc)
    note = S.DS_HIST_NOTE.format(n=HIST_ROWS) if len(rows) > HIST_ROWS else ""
    return [len(s.prompt) + max(len(a) for a in s.answers) for s in samples], note


def preference_view(state: dict[str, Any], total_rows: int, model: str) -> dict[str, Any]:
    """The tab's outputs for a preference file: status, summary, preview (answers side by side),
    report, histogram, row, datasets; registers the file in the job store. `state` is updated."""
    from kestrel import jobs
    from kestrel.studio.handlers.datasets import _stats, dataset_choices, histogram_update

    data = load(state)
    lengths, note = _lengths(data.rows, model)
    stats = _stats(lengths)
    what = S.DS_PREFERENCE_FORMATS[data.kind].format(layout=data.layout)
    jobs.add_dataset(state["path"], name=state["name"], format=what, rows=len(data.rows),
                     token_stats=stats if stats.get("max") else None)
    lines = [r.line for r in data.rows]
    return {
        "status": S.DS_LOADED.format(name=state["name"], good=len(data.rows), format=what),
        "summary": S.DS_SUMMARY.format(name=state["name"], format=what, rows=total_rows, good=len(data.rows),
                                       bad=len(data.bad), mean=stats["mean"], p95=stats["p95"], max=stats["max"],
                                       note=note),
        "preview": side_by_side(data.rows), "histogram": histogram_update(lengths),
        "report": pd.DataFrame({"line": [b.line for b in data.bad], "reason": [b.reason for b in data.bad]}),
        "row": gr.update(value=lines[0], minimum=lines[0], maximum=lines[-1]),
        "datasets": gr.update(choices=dataset_choices(), value=state["path"]), "format": gr.update(value="auto"),
    }


def preference_tokens(state: dict[str, Any], line: float | None, model: str, max_len: float) -> dict[str, Any]:
    """The tokens of the row at `line`: the prompt (masked), then each answer (trained), each
    headed by its name; tokens past max_len (prompt + that answer) marked cut."""
    from kestrel.data.preference_tokens import tokenize_preferences

    data = load(state)
    wanted = int(line or data.rows[0].line)
    row = next((r for r in data.rows if r.line == wanted), None)
    if row is None:
        raise DatasetError(S.DS_NO_ROW.format(line=wanted, first=data.rows[0].line, last=data.rows[-1].line))
    tokenizer, limit = tokenizer_for(model), int(max_len or 1024)
    (sample,), _ = tokenize_preferences(tokenizer, [row], 1 << 30)
    labels = S.DS_TOKEN_LABELS
    pieces: list[tuple[str, str | None]] = [(tokenizer.decode([t]), labels["masked"]) for t in sample.prompt]
    names = ["completion"] if row.rejected is None else ["chosen", "rejected"]
    for name, answer in zip(names, sample.answers):
        pieces.append((f"\n[{name}]\n", None))
        room = limit - len(sample.prompt)
        pieces += [(tokenizer.decode([t]), labels["trained" if i < room else "cut"]) for i, t in enumerate(answer)]
    summary = S.DS_PREFERENCE_TOKENS.format(line=wanted, prompt=len(sample.prompt), model=model,
                                            answers=", ".join(f"{n} {len(a)}" for n, a in zip(names, sample.answers)))
    return {"tokens": pieces, "token_summary": summary}
