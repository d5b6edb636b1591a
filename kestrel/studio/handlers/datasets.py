"""Datasets tab handlers: upload, detect the format, map columns, preview, validate, tokens.

Each handler returns a dict of named outputs (the keys of `kestrel.studio.components.datasets`); the
tab's state is a plain dict `{"path", "name", "format", "columns", "usable"}` kept in `gr.State`
(`columns`: the mapping the user chose, saved with the dataset in the job store; `usable`: a format
was found, so the token preview has rows to show).

    out = upload_dataset("/tmp/x/my data.jsonl", max_mb=100)
    out["state"]["format"]       # "messages"
    token_preview(out["state"], line=1, model="demo", max_len=128, responses_only=True)
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from kestrel.errors import DatasetError, KestrelError
from kestrel.paths import SAMPLE_DATASETS, resolve_dataset_path
from kestrel.studio import files
from kestrel.studio import strings as S
from kestrel.studio.handlers.common import model_config, tokenizer_for, user_errors
from kestrel.studio.handlers.preference_data import preference_kind_of, preference_tokens, preference_view

PREVIEW_ROWS = 10
HIST_ROWS = 2000  # rows tokenized for the histogram and the stats
MAX_CELL = 200  # characters of a cell in the preview
MAX_PREVIEW_TOKENS = 2048


def _formats() -> dict[str, tuple[str, ...]]:
    from kestrel.data.formats import FORMATS, OPTIONAL_ROLES

    return {fmt: tuple(roles) + tuple(OPTIONAL_ROLES.get(fmt, ())) for fmt, roles in FORMATS.items()}


def roles() -> list[str]:
    """Every role any format uses, in a stable order (one column dropdown each)."""
    out: list[str] = []
    for fmt_roles in _formats().values():
        out += [r for r in fmt_roles if r not in out]
    return out


def format_choices() -> list[str]:
    return ["auto", *_formats()]


def sample_choices() -> list[tuple[str, str]]:
    return [(p.name, str(p)) for p in sorted(SAMPLE_DATASETS.glob("*")) if p.suffix in files.DATASET_EXTENSIONS]


def dataset_choices() -> list[tuple[str, str]]:
    """(label, path) of every registered dataset that still exists, then the samples."""
    from kestrel import jobs

    seen, out = set(), []
    for d in jobs.list_datasets():
        if Path(d.path).is_file() and d.path not in seen:
            seen.add(d.path)
            out.append((f"{d.name} · {d.format or '?'} · {d.rows or '?'} rows", d.path))
    out += [(f"sample: {label}", path) for label, path in sample_choices() if path not in seen]
    return out


# ---------------------------------------------------------------------------------------------
# Reading (cached per file version: the preview, the report and the token view share one read)


@functools.lru_cache(maxsize=4)
def _table(path: str, _mtime: float) -> Any:
    """The file's usable rows with their line numbers (a `kestrel.data.reader.Table`)."""
    from kestrel.data.reader import read_table

    return read_table(path)


@functools.lru_cache(maxsize=8)
def _conversations(path: str, _mtime: float, fmt: str, columns: tuple[tuple[str, str], ...]) -> tuple:
    from kestrel.data.formats import load_conversations

    return load_conversations(path, fmt, dict(columns))


def _key(path: str) -> tuple[str, float]:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(S.ERR_DATASET_MISSING.format(path=path))
    return str(p), p.stat().st_mtime


def conversations(state: dict[str, Any]) -> tuple[str, list, list]:
    """(format, usable conversations, bad rows) of the dataset in `state`."""
    path, mtime = _key(state["path"])
    cols = tuple(sorted((state.get("columns") or {}).items()))
    return _conversations(path, mtime, state.get("format") or "auto", cols)


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= MAX_CELL else text[:MAX_CELL] + "…"


def preview_frame(rows: list[dict[str, Any]], lines: list[int]) -> pd.DataFrame:
    """The first rows, each with the line of the file it came from (skipped lines leave gaps)."""
    head = rows[:PREVIEW_ROWS]
    columns = list(dict.fromkeys(k for r in head for k in r))
    data = [[line] + [_cell(r.get(c, "")) for c in columns] for line, r in zip(lines, head)]
    return pd.DataFrame(data, columns=["line", *columns])


def _mapping_updates(fmt: str | None, present: list[str], columns: dict[str, str]) -> dict[str, Any]:
    """One dropdown per role: visible for the format's roles, showing the column each reads (the
    chosen one, else the one its common names found)."""
    from kestrel.data.formats import resolve_columns

    needed = _formats().get(fmt or "", ())
    found = (resolve_columns(present, fmt, columns) if fmt in _formats() else None) or {}
    out = {}
    for role in roles():
        value = columns.get(role) or found.get(role) or (role if role in present else None)
        out[f"col_{role}"] = gr.update(choices=present, value=value, visible=role in needed)
    return out


@functools.lru_cache(maxsize=8)
def _measured(path: str, _mtime: float, fmt: str, columns: tuple[tuple[str, str], ...], model: str) -> tuple[int, ...]:
    _, good, _ = _conversations(path, _mtime, fmt, columns)
    return tuple(token_lengths(good[:HIST_ROWS], tokenizer_for(model)))


def measured_lengths(state: dict[str, Any], model: str) -> list[int]:
    """Tokens per row of the first HIST_ROWS usable rows of the dataset in `state`, with `model`'s
    tokenizer (cached: the histogram, the stats and both tabs' truncation warnings share one count)."""
    path, mtime = _key(state["path"])
    cols = tuple(sorted((state.get("columns") or {}).items()))
    return list(_measured(path, mtime, state.get("format") or "auto", cols, model))


def truncation_note(dataset: str, fmt: str, columns: dict[str, str] | None, model: str, max_len: Any) -> str:
    """The truncation warning (markdown) for this dataset read this way, or "" when few rows are cut
    or nothing can be measured without a download (the Train tab calls this on every edit)."""
    from kestrel.data.lengths import truncation, truncation_message

    try:
        if not dataset or model_config(model) is None:
            return ""
        found = truncation(measured_lengths({"path": str(resolve_dataset_path(dataset)), "format": fmt,
                                             "columns": columns or {}}, model), int(max_len))
    except (KestrelError, TypeError, ValueError):
        return ""
    return truncation_message(found) if found else ""


def token_lengths(convs: list, tokenizer: Any) -> list[int]:
    """Tokens per conversation as training renders it (chat template, or raw text + EOS)."""
    texts = [c.text if c.text is not None else
             tokenizer.apply_chat_template(c.messages, tokenize=False, add_generation_prompt=False)
             for c in convs]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def histogram_frame(lengths: list[int], bins: int = 20) -> pd.DataFrame:
    """Rows per token-length bucket, from the shortest to the longest row; `tokens` labels each
    bucket with its range ("24-31")."""
    if not lengths:
        return pd.DataFrame({"tokens": [], "rows": []})
    lo, hi = min(lengths), max(lengths)
    width = max(1, math.ceil((hi - lo + 1) / bins))
    counts = [0] * math.ceil((hi - lo + 1) / width)
    for n in lengths:
        counts[(n - lo) // width] += 1
    starts = [lo + i * width for i in range(len(counts))]
    labels = [str(a) if width == 1 else f"{a}-{a + width - 1}" for a in starts]
    return pd.DataFrame({"tokens": labels, "rows": counts})


def histogram_update(lengths: list[int]) -> dict[str, Any]:
    """The bar chart's update: the value only (buckets in length order, which the plot keeps: its
    `sort=[]` is set once in the layout; a changing `sort` made it draw the previous dataset)."""
    frame = histogram_frame(lengths)
    return gr.update(value=frame)


def _stats(lengths: list[int]) -> dict[str, float]:
    ordered = sorted(lengths)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else 0
    return {"total": sum(ordered), "mean": sum(ordered) / max(1, len(ordered)), "p95": p95,
            "max": ordered[-1] if ordered else 0, "rows_measured": len(ordered)}


# ---------------------------------------------------------------------------------------------
# Handlers


@user_errors
def upload_dataset(file_path: str | None, max_mb: float, model: str = "demo") -> dict[str, Any]:
    """Copy an uploaded file into KESTREL_HOME/datasets and open it (see `open_dataset`)."""
    if not file_path:
        raise DatasetError(S.ERR_NO_FILE)
    try:
        stored = files.store_upload(file_path, Path(file_path).name, int(max_mb * 2**20))
    except DatasetError:
        files.discard_upload(file_path)  # a refused file (a .py, a renamed binary) leaves no copy behind
        raise
    try:
        return open_dataset(str(stored), model=model)
    except gr.Error:
        stored.unlink(missing_ok=True)  # unreadable: do not keep it (a reused file is readable)
        raise


@user_errors
def open_dataset(path: str, fmt: str = "auto", columns: dict[str, str] | None = None,
                 model: str = "demo") -> dict[str, Any]:
    """Read `path` (a sample's name or a file inside KESTREL_HOME), detect (or apply) its format and
    column mapping, validate every row.

    `columns` None: the mapping saved with the dataset in the job store, with its format, when the
    file still has those columns.
    Outputs: state, status, summary, format, col_<role> (one per role), preview, report,
    histogram, row (the token-preview line number), datasets (choices of both dropdowns), and
    tokens, token_summary, truncation (cleared; the token preview refills them).
    A dataset that matches no format still shows its preview and columns, so the user can map.
    """
    from kestrel import jobs

    if not path:
        raise DatasetError(S.DS_NO_DATASET)
    path, mtime = _key(str(files.studio_dataset(path)))  # inside KESTREL_HOME, checked before any read
    table = _table(path, mtime)
    rows = table.rows
    present = list(dict.fromkeys(k for r in rows[:100] for k in r))
    if columns is None:  # the saved mapping, while the file still has its columns (a new upload may not)
        saved = jobs.saved_mapping(path)
        fmt, columns = saved if saved and set(saved[1].values()) <= set(present) else (fmt, {})
    columns = {k: v for k, v in columns.items() if v and v != k}
    name = Path(path).name
    state = {"path": path, "name": name, "format": fmt, "columns": columns, "usable": False}
    out: dict[str, Any] = {"state": state, "preview": preview_frame(rows, table.lines),
                           "report": pd.DataFrame({"line": [i.line for i in table.issues],
                                                   "reason": [i.reason for i in table.issues]}),
                           "histogram": histogram_update([]), "row": gr.update(),
                           "tokens": None, "token_summary": "", "truncation": ""}
    kind = preference_kind_of(present, columns) if fmt == "auto" else None
    if kind:  # chosen / rejected, or KTO's prompt / completion / label: previewed side by side
        state.update(preference=kind, usable=True)  # usable by the preference methods: previewed, carried to Train
        out.update(_mapping_updates(None, present, columns))
        out.update(preference_view(state, len(rows) + len(table.issues), model))
        return out
    try:
        found, good, bad = conversations(state)
    except DatasetError as exc:
        out.update(status=f"⚠️ {exc}", format=gr.update(value=fmt),
                   summary=S.DS_SUMMARY_NOFORMAT.format(name=name, rows=len(rows) + len(table.issues),
                                                        columns=", ".join(present)),
                   datasets=gr.update(), **_mapping_updates(fmt if fmt != "auto" else None, present, columns))
        return out
    state.update(format=found, usable=True)
    out.update(_analysis(state, len(rows) + len(table.issues), good, bad, model))
    out.update(format=gr.update(value=found), **_mapping_updates(found, present, columns))
    return out


def _analysis(state: dict[str, Any], rows: int, good: list, bad: list, model: str) -> dict[str, Any]:
    """Token statistics, histogram, validation report; registers the dataset (with the mapping
    the user chose) in the job store."""
    from kestrel import jobs

    note, stats, hist = "", {"mean": 0, "p95": 0, "max": 0}, histogram_update([])
    try:
        lengths = measured_lengths(state, model)
        stats, hist = _stats(lengths), histogram_update(lengths)
        note = S.DS_HIST_NOTE.format(n=HIST_ROWS) if len(good) > HIST_ROWS else ""
    except KestrelError as exc:  # a model whose tokenizer cannot load: the rest still helps
        note = S.ERR_NO_TOKEN_COUNTS.format(error=exc)
    jobs.add_dataset(state["path"], name=state["name"], format=state["format"], rows=len(good),
                     token_stats=stats if stats.get("max") else None, columns=state["columns"])
    summary = S.DS_SUMMARY.format(name=state["name"], format=state["format"], rows=rows, good=len(good),
                                  bad=len(bad), mean=stats["mean"], p95=stats["p95"], max=stats["max"], note=note)
    if state["columns"]:
        summary += S.DS_MAPPING_SAVED.format(mapping=", ".join(f"{r} ← {c}" for r, c in state["columns"].items()))
    lines = [c.line for c in good]
    return {"status": S.DS_LOADED.format(name=state["name"], good=len(good), format=state["format"]),
            "summary": summary, "histogram": hist,
            "report": pd.DataFrame({"line": [b.line for b in bad], "reason": [b.reason for b in bad]}),
            "row": gr.update(value=lines[0], minimum=lines[0], maximum=lines[-1]),
            "datasets": gr.update(choices=dataset_choices(), value=state["path"])}


def show_roles(fmt: str | None) -> dict[str, Any]:
    """The column dropdowns of the format just picked (before Apply reads the file with it).
    Outputs: col_<role>."""
    needed = _formats().get(fmt or "", ())
    return {f"col_{role}": gr.update(visible=role in needed) for role in roles()}


@user_errors
def apply_mapping(state: dict[str, Any] | None, fmt: str, model: str, *role_columns: str | None) -> dict[str, Any]:
    """Re-read the dataset with the format and role -> column mapping the user chose."""
    if not state or not state.get("path"):
        raise DatasetError(S.DS_NO_DATASET)
    needed = _formats().get(fmt, ())
    columns = {role: col for role, col in zip(roles(), role_columns) if col and role in needed}
    return open_dataset(state["path"], fmt, columns, model)


@user_errors
def token_preview(state: dict[str, Any] | None, line: float | None, model: str, max_len: float,
                  responses_only: bool = True) -> dict[str, Any]:
    """The tokens of the row at `line`: each piece of text labelled trained, masked or cut (past
    max_len); and the truncation warning for the whole dataset at this max_len.

    Outputs: tokens (HighlightedText value: (text, label) pairs), token_summary, truncation (markdown).
    """
    from kestrel.data.tokenize import IGNORE, decode_pieces, tokenize_conversation

    if not state or not state.get("path"):
        raise DatasetError(S.DS_NO_DATASET)
    if state.get("preference"):
        return preference_tokens(state, line, model, max_len)
    _, good, _ = conversations(state)
    wanted = int(line or good[0].line)
    conv = next((c for c in good if c.line == wanted), None)
    if conv is None:
        raise DatasetError(S.DS_NO_ROW.format(line=wanted, first=good[0].line, last=good[-1].line))
    tokenizer = tokenizer_for(model)
    max_len = int(max_len or 1024)
    sample = tokenize_conversation(tokenizer, conv, 1 << 30, bool(responses_only))
    pieces = []
    for text, _, end in decode_pieces(tokenizer, sample.input_ids[:MAX_PREVIEW_TOKENS]):
        # a piece cut in the middle (a character split by max_len) counts as cut
        kind = "cut" if end > max_len else ("masked" if sample.labels[end - 1] == IGNORE else "trained")
        pieces.append((text, S.DS_TOKEN_LABELS[kind]))
    total = len(sample.input_ids)
    trained = sum(1 for t in sample.labels[:max_len] if t != IGNORE)
    cut = max(0, total - max_len)
    summary = S.DS_TOKEN_SUMMARY.format(
        line=wanted, total=total, trained=trained, masked=min(total, max_len) - trained, model=model,
        cut=S.DS_TOKEN_CUT.format(cut=cut, max_len=max_len) if cut else "")
    return {"tokens": pieces, "token_summary": summary,
            "truncation": truncation_note(state["path"], state.get("format") or "auto", state.get("columns"),
                                          model, max_len)}


@user_errors
def refresh_choices() -> dict[str, Any]:
    """Fresh choices for the dataset dropdowns (after another tab or the command line added one)."""
    return {"datasets": gr.update(choices=dataset_choices())}
