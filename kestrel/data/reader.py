"""The one dataset reader. Every entry point (training from the CLI or a job, the studio's open and
preview, the upload check) reads files through this module, so all of them refuse the same files
with the same messages, naming the file, the line and the fix.

Untrusted bytes never reach a native parser inside this process: JSON and JSONL go through
Python's `json` module after a bracket-depth scan, CSV through the `csv` module, and Parquet (a
binary format only tools write) through pyarrow in a child process, so a crash there ends in a
DatasetError naming the file instead of taking down the studio or a worker.

    table = read_table("data.jsonl")
    table.rows[0], table.lines[0]   # the first usable row and the line it came from
    table.issues                    # [RowIssue(line=3, reason="is not valid JSON: ...")]

A line that cannot be used (not JSON, not an object, not UTF-8, two objects on it, nested too
deep, too long) is skipped into `issues`; a file is refused only when no usable row is left, or
when its bytes are not text at all (compressed, binary, NUL bytes).
"""

from __future__ import annotations

import csv
import json
import pickle
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from kestrel.errors import DatasetError
from kestrel.paths import resolve_dataset_path

EXTENSIONS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

# Limits, each with why.
MAX_DEPTH = 64  # rows nest < 10 levels (row > messages > message > tool call); 64 keeps recursive walks far from Python's limit
MAX_LINE_BYTES = 16 * 2**20  # one JSONL row or CSV field; a longer "line" is a whole file without newlines, or binary junk
MAX_JSON_BYTES = 2**30  # a .json file is parsed whole (~10x its size in memory); more belongs in .jsonl, read line by line
PARQUET_TIMEOUT_S = 600  # a Parquet read that takes longer is stuck (a decompression bomb), not slow
HEAD_BYTES = 64 * 1024  # what the content check reads before anything else (the upload check reads no more)
LISTED_ISSUES = 5  # issues quoted in a refusal; the validation report keeps them all

PARQUET_CHILD = Path(__file__).with_name("_parquet_child.py")

# (leading bytes, what the file is, what to do); checked before any parser sees the file
_MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"\x1f\x8b", "gzip-compressed", "decompress it first (gunzip)"),
    (b"PK\x03\x04", "a zip archive (or an Excel workbook)", "unzip it, or save the sheet as .csv, first"),
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it first (unxz)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it first (unzstd)"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", "extract it first"),
    (b"PAR1", "a Parquet file", "name it .parquet"),
    (b"\x89PNG", "a PNG image", "upload the dataset file itself"),
    (b"\xff\xd8\xff", "a JPEG image", "upload the dataset file itself"),
    (b"GIF8", "a GIF image", "upload the dataset file itself"),
    (b"%PDF", "a PDF document", "upload the dataset file itself"),
    (b"\xff\xfe", "UTF-16 text", "save it as UTF-8"),
    (b"\xfe\xff", "UTF-16 text", "save it as UTF-8"),
)
_BZIP2 = re.compile(rb"BZh[1-9]1AY&SY")
# a JSON string (its closing quote optional, so an unterminated one never backtracks) or a bracket
_STRING = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"?'
_STRINGS = re.compile(_STRING, re.DOTALL)
_SCAN_CHUNK = 1 << 24
_STEPS = np.zeros(256, np.int8)  # byte -> depth change
_STEPS[[ord("["), ord("{")]], _STEPS[[ord("]"), ord("}")]] = 1, -1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_UNDECODABLE = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, kept by surrogateescape
_DECODER = json.JSONDecoder()


@dataclass
class RowIssue:
    """A row that cannot be used; `line` is 1-based (the line of a .jsonl or .csv, the row of a .json
    array or a .parquet)."""

    line: int
    reason: str


@dataclass
class Table:
    """The usable rows of a file, the line each came from, and the lines that could not be used."""

    path: Path
    unit: str = "line"  # what `lines` count: "line" (.jsonl, .csv) or "row" (.json arrays, .parquet)
    rows: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    issues: list[RowIssue] = field(default_factory=list)

    def add(self, line: int, row: dict[str, Any] | str) -> None:
        """Keep `row`, or record it as an issue when it is the reason it cannot be used."""
        if isinstance(row, str):
            self.issues.append(RowIssue(line, row))
        else:
            self.rows.append(row)
            self.lines.append(line)


def list_issues(issues: list[RowIssue], unit: str) -> str:
    """The first few issues as `line 3: reason; line 7: reason; and 12 more`."""
    text = "; ".join(f"{unit} {i.line}: {i.reason}" for i in issues[:LISTED_ISSUES])
    more = len(issues) - LISTED_ISSUES
    return f"{text}; and {more} more" if more > 0 else text


# ---------------------------------------------------------------------------------------------
# Content checks on raw bytes (the upload check runs the same ones)


def _line_of(data: bytes | str, offset: int) -> int:
    """The 1-based line of `offset` in `data`."""
    return data.count(b"\n" if isinstance(data, bytes) else "\n", 0, offset) + 1


def check_head(head: bytes, name: str, ext: str) -> None:
    """Refuse a file whose first bytes show it is not `ext` text: compressed, an archive, an image,
    UTF-16, NUL bytes, or (for .json) not starting like JSON; or, for .parquet, no PAR1 signature."""
    if ext == ".parquet":
        if not head.startswith(b"PAR1"):
            raise DatasetError(f"{name} is not a Parquet file (it lacks the PAR1 signature). "
                               "Is it another kind of file renamed?")
        return
    for magic, kind, fix in _MAGIC:
        if head.startswith(magic):
            raise DatasetError(f"{name} is {kind} (binary data), not {ext} text: {fix}.")
    if _BZIP2.match(head):
        raise DatasetError(f"{name} is bzip2-compressed (binary data), not {ext} text: decompress it first (bunzip2).")
    _refuse_nul(head, name, ext)
    text = head.decode("utf-8", errors="ignore").lstrip("\ufeff \t\r\n")
    json_scalar = text[:1] in tuple('"-0123456789') or text.startswith(("null", "true", "false"))
    if ext == ".json" and text and text[0] not in "[{" and not json_scalar:  # a scalar is refused once parsed
        raise DatasetError(f"{name} does not start like JSON ({ext} files start with {{ or [). "
                           "Is it another kind of file renamed?")


def check_file(path: Path, name: str | None = None) -> None:
    """The byte-level checks of `check_head` on a file, plus Parquet's closing PAR1 signature."""
    name = name or path.name
    ext = Path(name).suffix.lower()
    with open(path, "rb") as fh:
        check_head(fh.read(HEAD_BYTES), name, ext)
        if ext == ".parquet":
            size = fh.seek(0, 2)
            fh.seek(max(0, size - 4))
            if size < 12 or fh.read(4) != b"PAR1":
                raise DatasetError(f"{name} is not a complete Parquet file (it does not end with PAR1): it was "
                                   "cut short; export or upload it again.")


def _refuse_nul(data: bytes, name: str, ext: str, first_line: int = 1) -> None:
    """Refuse text with a NUL byte in it (binary data), naming its line (`data` starts on `first_line`)."""
    nul = data.find(b"\x00")
    if nul >= 0:
        line = first_line + _line_of(data, nul) - 1
        raise DatasetError(f"{name} contains binary data (a NUL byte on line {line}), so it is not a {ext} text "
                           "file. Is it another kind of file renamed?")


def _refuse_nul_stream(path: Path, name: str, ext: str) -> None:
    """NUL bytes anywhere in the file, found a chunk at a time (C speed, bounded memory)."""
    lines = 1
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            _refuse_nul(chunk, name, ext, lines)
            lines += chunk.count(b"\n")


# ---------------------------------------------------------------------------------------------
# JSON values and lines


def too_deep(text: str) -> int | None:
    """The line (1-based) where brackets outside strings first nest deeper than MAX_DEPTH, or None.
    Linear time at C speed: strings cut out by a regex, then a running sum over the brackets left
    (numpy, a chunk at a time, so a flood stops early). Run before `json`: a flood never reaches it."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return None
    outside = _STRINGS.sub("", text).encode("utf-8", errors="surrogatepass")
    depth = 0
    for start in range(0, len(outside), _SCAN_CHUNK):
        chunk = np.frombuffer(outside, np.uint8, min(_SCAN_CHUNK, len(outside) - start), start)
        sums = np.cumsum(_STEPS[chunk], dtype=np.int64) + depth
        over = np.flatnonzero(sums > MAX_DEPTH)
        if over.size:
            return outside.count(b"\n", 0, start + int(over[0])) + 1  # strings in valid JSON hold no newline
        depth = int(sums[-1])
    return None


def _deep_reason() -> str:
    """Why a value nested past MAX_DEPTH is refused, and what to do."""
    return f"is nested deeper than {MAX_DEPTH} levels; dataset rows never are: flatten it or check that this is the right file"


def _has_lone_surrogate(source: str, value: Any) -> bool:
    """Whether `value` holds a \\udXXX escape that is half of a character (text no tokenizer takes)."""
    if not _SURROGATE_ESCAPE.search(source):
        return False
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _kind(value: Any) -> str:
    """What a JSON value is, in words ("null", "a number", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    return {str: "a string", list: "a JSON array", dict: "a JSON object"}.get(type(value), type(value).__name__)


def as_row(value: Any, source: str = "") -> dict[str, Any] | str:
    """`value` when it is a usable row (a JSON object), else why not."""
    if isinstance(value, dict):
        if _has_lone_surrogate(source, value):
            return "holds a \\ud800-\\udfff escape that is half of a character: fix the text's encoding"
        return value
    if isinstance(value, list):
        return "is a JSON array, not an object: one {...} row per line (an array of rows belongs in a .json file)"
    return f"is {_kind(value)}, not a JSON object {{...}}"


def _json_problem(exc: ValueError, text: str) -> str:
    """Why `json` refused a line, in one sentence."""
    if isinstance(exc, json.JSONDecodeError):
        cut = exc.msg.startswith("Unterminated") or exc.pos >= len(text.rstrip()) - 1
        hint = " (the line looks cut short)" if cut else ""
        return f"is not valid JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}{hint}"
    return f"is not valid JSON: {str(exc).split(';')[0][:200]}"  # e.g. an integer over Python's digit limit


def parse_line(text: str) -> dict[str, Any] | str:
    """The object on one JSONL line, or why it cannot be used."""
    text = text.rstrip("\r\n")
    start = len(text) - len(text.lstrip())
    if too_deep(text) is not None:
        return _deep_reason()
    try:
        value, end = _DECODER.raw_decode(text, start)
    except RecursionError:  # not reached after too_deep; json raises it (never crashes) past Python's limit
        return _deep_reason()
    except ValueError as exc:  # JSONDecodeError, or an integer over Python's digit limit
        return _json_problem(exc, text)
    rest = text[end:].strip()
    if rest:
        if rest[0] in "[{":
            return "holds more than one JSON value (two objects on one line?): put each row on its own line"
        return f"has extra text after the JSON value at column {end + 1}: {rest[:20]!r}"
    return as_row(value, text)


# ---------------------------------------------------------------------------------------------
# Files


def _raw_lines(fh: IO[bytes]) -> Iterator[bytes | int]:
    """Each line's bytes, or its length in bytes when it is over MAX_LINE_BYTES (never held whole)."""
    while raw := fh.readline(MAX_LINE_BYTES + 1):
        if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
            yield raw
            continue
        size = len(raw)
        while (more := fh.readline(1 << 20)) and not more.endswith(b"\n"):
            size += len(more)
        yield size + len(more)


def _size(n: int) -> str:
    """A byte count in words: "17 MiB", "5 KiB", "300 bytes"."""
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} bytes"


def _decode_line(raw: bytes) -> str:
    """A line's text; UnicodeDecodeError's message is rewritten to say where and what to do."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        byte = raw[exc.start]
        raise ValueError(f"is not UTF-8 text (byte 0x{byte:02x} at column {exc.start + 1}): save the file as UTF-8") from exc


def _read_jsonl(path: Path, name: str) -> Table:
    """One JSON object per line; unusable lines become issues."""
    table = Table(path)
    with open(path, "rb") as fh:
        check_head(fh.read(HEAD_BYTES), name, ".jsonl")
        fh.seek(0)
        for number, raw in enumerate(_raw_lines(fh), 1):
            if isinstance(raw, int):
                table.add(number, f"is {_size(raw)} long, over the {_size(MAX_LINE_BYTES)} limit for one row")
                continue
            _refuse_nul(raw, name, ".jsonl", number)
            try:
                text = _decode_line(raw)
            except ValueError as exc:
                table.add(number, str(exc))
                continue
            text = text.removeprefix("\ufeff") if number == 1 else text
            if text.strip():
                table.add(number, parse_line(text))
    return table


def _lines_table(path: Path, text: str) -> Table:
    """JSON Lines that came as text (a .jsonl saved under the name .json)."""
    table = Table(path)
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            table.add(number, parse_line(line))
    return table


def _decode_whole(data: bytes, name: str) -> str:
    """A whole file's UTF-8 text (a BOM dropped), or DatasetError naming the line of the bad byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{name} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line "
                           f"{_line_of(data, exc.start)}): save it as UTF-8") from exc


def _read_json(path: Path, name: str) -> Table:
    """A .json document: an array of objects, an object holding one list of rows, or one row."""
    if path.stat().st_size > MAX_JSON_BYTES:
        raise DatasetError(f"{name} is over {_size(MAX_JSON_BYTES)}; a .json file is read whole, so save "
                           "large data as .jsonl (one row per line)")
    data = path.read_bytes()
    check_head(data[:HEAD_BYTES], name, ".json")
    _refuse_nul(data, name, ".json")
    text = _decode_whole(data, name)
    if not text.strip():
        raise DatasetError(f"dataset file {name} has no rows: it holds only whitespace")
    deep = too_deep(text)
    if deep is not None:
        raise DatasetError(f"{name}: line {deep} {_deep_reason()}")
    try:
        document = json.loads(text)
    except RecursionError as exc:  # not reached after too_deep; json raises it (never crashes) past Python's limit
        raise DatasetError(f"{name}: the document {_deep_reason()}") from exc
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            return _lines_table(path, text)  # JSON Lines named .json
        raise DatasetError(f"could not read {name}: it is not valid JSON: {exc.msg} at line {exc.lineno}, "
                           f"column {exc.colno}") from exc
    except ValueError as exc:  # an integer over Python's digit limit
        raise DatasetError(f"could not read {name}: it is not valid JSON: {str(exc).split(';')[0][:200]}") from exc
    return _json_rows(path, name, document, text)


def _is_message_list(items: list[Any]) -> bool:
    """Whether `items` are chat messages (one row's `messages`), not rows."""
    return all(isinstance(m, dict) and ("role" in m or "from" in m) for m in items)


def _json_rows(path: Path, name: str, document: Any, text: str) -> Table:
    """The rows of a parsed .json document (element index as the row number)."""
    if isinstance(document, dict):
        inner = next(iter(document.values())) if len(document) == 1 else None
        if isinstance(inner, list) and inner and not _is_message_list(inner):
            document = inner  # {"data": [{...}, {...}]}
        else:
            table = Table(path, unit="row")
            table.add(1, as_row(document, text))
            return table
    if not isinstance(document, list):
        raise DatasetError(f"{name} holds {_kind(document)}, not rows: a .json dataset is an array of objects, "
                           "[{...}, {...}]")
    table = Table(path, unit="row")
    check = bool(_SURROGATE_ESCAPE.search(text))
    for index, value in enumerate(document, 1):
        table.add(index, as_row(value, text if check else ""))
    return table


def _csv_records(fh: IO[str], name: str, table: Table) -> None:
    """Rows of a CSV stream under its header; a record with the wrong field count or bytes that are
    not UTF-8 becomes an issue; a csv.Error (a field over the limit) refuses the file."""
    reader = csv.reader(fh)
    try:
        header = next(reader, None)
        if not header:
            raise DatasetError(f"{name} has no header row: its first line must name the columns")
        if _UNDECODABLE.search("".join(header)):
            raise DatasetError(f"{name}: the header (line 1) is not UTF-8 text: save the file as UTF-8")
        twice = sorted({c for c in header if header.count(c) > 1})
        if twice:
            raise DatasetError(f"{name}: column {twice[0]!r} appears twice in the header (line 1): rename one")
        start = reader.line_num + 1
        for record in reader:
            line, start = start, reader.line_num + 1
            if not record:
                continue
            if len(record) != len(header):
                table.add(line, f"has {len(record)} fields, the header has {len(header)}: check its commas and quotes")
            elif _UNDECODABLE.search("".join(record)):
                table.add(line, "is not UTF-8 text: save the file as UTF-8")
            else:
                table.add(line, dict(zip(header, record)))
    except csv.Error as exc:
        raise DatasetError(f"could not read {name}: line {reader.line_num}: {exc} (a field over "
                           f"{_size(MAX_LINE_BYTES)}: a quote left open?)") from exc


def _read_csv(path: Path, name: str) -> Table:
    """A CSV file with a header row, read by Python's csv module (every value a string)."""
    check_file(path, name)
    _refuse_nul_stream(path, name, ".csv")
    csv.field_size_limit(MAX_LINE_BYTES)  # process-wide, but always set to this same value
    table = Table(path)
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as fh:
        _csv_records(fh, name, table)
    return table


def _read_parquet(path: Path, name: str) -> Table:
    """A Parquet file, decoded by pyarrow in a child process: a native crash there (a damaged file)
    becomes a DatasetError here. The child sends the rows back pickled; the bytes come from
    `pickle.dumps` in our own child, never from the file."""
    check_file(path, name)
    try:
        # -P: not the script's folder first on sys.path (kestrel/data/tokenize.py would shadow the stdlib's)
        done = subprocess.run([sys.executable, "-P", str(PARQUET_CHILD), str(path)], capture_output=True,
                              timeout=PARQUET_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DatasetError(f"could not read {name}: the Parquet reader took over {PARQUET_TIMEOUT_S} s; "
                           "the file is damaged or far too large") from exc
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode).name if -done.returncode in signal.valid_signals() else done.returncode
        raise DatasetError(f"could not read {name}: the Parquet reader crashed on it ({sig}); the file is damaged, "
                           "export it again")
    if done.returncode != 0:
        lines = done.stderr.decode("utf-8", errors="replace").strip().splitlines() or ["no message"]
        raise DatasetError(f"could not read {name} as Parquet: {lines[-1][:300]}")
    try:
        rows = pickle.loads(done.stdout)
    except Exception as exc:  # noqa: BLE001 - a cut-short answer from the child
        raise DatasetError(f"could not read {name}: the Parquet reader's answer was cut short ({exc})") from exc
    return Table(path, unit="row", rows=rows, lines=list(range(1, len(rows) + 1)))


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}


def read_table(name: str) -> Table:
    """The usable rows of a dataset file (or shipped sample), their line numbers, and the lines
    skipped with why; DatasetError naming the file when nothing usable is left."""
    path = resolve_dataset_path(name)
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist (or is not a file); upload it again or pick a sample")
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DatasetError(
            f"dataset file {path.name}: unsupported extension {path.suffix!r}; use .jsonl, .json, .csv or .parquet")
    if path.stat().st_size == 0:
        raise DatasetError(f"dataset file {path.name} is empty")
    table = reader(path, path.name)
    if not table.rows and table.issues:
        total = len(table.issues)
        raise DatasetError(f"could not read {path.name}: none of its {total} {table.unit}s holds a usable row "
                           f"({list_issues(table.issues, table.unit)})")
    if not table.rows:
        raise DatasetError(f"dataset file {path.name} has no rows")
    return table
