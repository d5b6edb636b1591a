"""The dataset reader on hostile files (issues 29 and 30): no crash, no hang, one message naming
the file, the line and the fix; unreadable lines skipped into the report with their numbers.

Each regression test says what the old reader (`datasets`/pyarrow under `read_rows`) did. The
ones through `read_rows`/`load_conversations` run unchanged against the old code, and fail there;
the tests of the new module (`kestrel.data.reader`: limits, the Parquet child) import it inside.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from kestrel.data.formats import load_conversations, read_rows
from kestrel.errors import DatasetError
from tests.support.hostile import dataset_base, dataset_mutant

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"prompt": "What is 2 + 3?", "completion": "5"}
DEEP = 20_000  # levels of nesting in the hostile files (the old reader segfaulted at 10,000)


def _jsonl(*lines: str) -> str:
    return "".join(line + "\n" for line in lines)


def _write(tmp_path: Path, name: str, data: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def _refusal(path: Path) -> str:
    """The message of the DatasetError that reading `path` raises; it names the file."""
    with pytest.raises(DatasetError) as err:
        load_conversations(str(path))
    message = str(err.value)
    assert path.name in message, message
    return message


# --- the files that crashed the old reader: refused, and the process lives ---------------------


def test_files_that_crashed_the_old_reader_leave_the_process_alive(tmp_path: Path) -> None:
    """Old: `.jsonl` nested 20,000 deep, a `.json` of `null` and `.jsonl` lines of `null` killed the
    process with SIGSEGV inside pyarrow (exit -11). Read in a child here, so a crash fails this test
    instead of the whole run: the child must exit 0 having got a DatasetError naming each file."""
    files = {"deep.jsonl": _jsonl('{"a": ' + "[" * DEEP + "]" * DEEP + "}"),
             "deep.json": "[" * DEEP + "]" * DEEP, "null.json": "null", "nulls.jsonl": _jsonl("null", "null")}
    for name, text in files.items():
        _write(tmp_path, name, text)
    script = textwrap.dedent("""
        import sys
        from kestrel.data.formats import read_rows
        from kestrel.errors import DatasetError
        for name in sys.argv[1:]:
            try:
                read_rows(name)
                print(name, "ROWS")
            except DatasetError as exc:
                print(name, "REFUSED" if name in str(exc) else "UNNAMED")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, *files], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == [w for name in files for w in (name, "REFUSED")], done.stdout


@pytest.mark.parametrize("ext", [".json", ".jsonl"])
def test_deep_nesting_is_refused_naming_file_line_and_limit(tmp_path: Path, ext: str) -> None:
    """Old: .jsonl segfaulted; .json said only 'An error occurred while generating the dataset'."""
    deep = "[" * DEEP + "]" * DEEP
    text = _jsonl(deep) if ext == ".jsonl" else "\n" + deep
    message = _refusal(_write(tmp_path, f"deep{ext}", text))
    assert "nested deeper than 64 levels" in message
    assert ("line 1: is nested" if ext == ".jsonl" else "line 2 is nested") in message


def test_a_deep_line_among_good_ones_is_skipped(tmp_path: Path) -> None:
    """Old: segfault. Now the deep line is one entry of the report and the others are used."""
    deep = '{"prompt": ' + "[" * DEEP + "]" * DEEP + "}"
    path = _write(tmp_path, "d.jsonl", _jsonl(json.dumps(GOOD), deep, json.dumps(GOOD)))
    _, convs, bad = load_conversations(str(path))
    assert [c.line for c in convs] == [1, 3]
    assert [b.line for b in bad] == [2] and "nested deeper than 64 levels" in bad[0].reason


def test_a_json_file_of_null_is_refused(tmp_path: Path) -> None:
    """Old: segfault."""
    message = _refusal(_write(tmp_path, "null.json", "null"))
    assert "holds null, not rows" in message and "array of objects" in message


def test_null_lines_are_skipped_with_their_numbers(tmp_path: Path) -> None:
    """Old: segfault."""
    path = _write(tmp_path, "n.jsonl", _jsonl("null", json.dumps(GOOD), "null"))
    _, convs, bad = load_conversations(str(path))
    assert [c.line for c in convs] == [2]
    assert [(b.line, b.reason) for b in bad] == [(1, "is null, not a JSON object {...}"),
                                                 (3, "is null, not a JSON object {...}")]


# --- issue 29 / 30 item 9: one broken line no longer rejects the file ---------------------------


def test_a_truncated_line_in_the_middle_is_skipped_with_its_number(tmp_path: Path) -> None:
    """Old: the whole file refused, 'could not read … An error occurred while generating the dataset',
    no line number."""
    cut = json.dumps(GOOD)[:20]
    path = _write(tmp_path, "t.jsonl", _jsonl(json.dumps(GOOD), cut, json.dumps(GOOD), json.dumps(GOOD)))
    fmt, convs, bad = load_conversations(str(path))
    assert fmt == "prompt_completion" and [c.line for c in convs] == [1, 3, 4]
    assert [b.line for b in bad] == [2]
    assert "not valid JSON" in bad[0].reason and "cut short" in bad[0].reason


def test_two_objects_on_one_line_are_not_two_rows(tmp_path: Path) -> None:
    """Old: read as two rows, the line numbers of every later row shifted by one."""
    path = _write(tmp_path, "two.jsonl", _jsonl(json.dumps(GOOD) + json.dumps(GOOD), json.dumps(GOOD)))
    _, convs, bad = load_conversations(str(path))
    assert [c.line for c in convs] == [2]
    assert [b.line for b in bad] == [1] and "more than one JSON value" in bad[0].reason


def test_invalid_utf8_on_a_line_is_a_one_line_reason(tmp_path: Path) -> None:
    """Old: UnicodeDecodeError escaped read_rows (a traceback in the studio, not a message)."""
    bad_line = b'{"prompt": "caf\xe9", "completion": "b"}'
    path = _write(tmp_path, "u.jsonl", json.dumps(GOOD).encode() + b"\n" + bad_line + b"\n")
    _, convs, bad = load_conversations(str(path))
    assert [c.line for c in convs] == [1]
    assert [b.line for b in bad] == [2]
    assert bad[0].reason == "is not UTF-8 text (byte 0xe9 at column 16): save the file as UTF-8"


def test_a_file_of_only_bad_lines_is_refused_listing_reasons(tmp_path: Path) -> None:
    """Old: 'could not read … An error occurred while generating the dataset', no line, no reason."""
    lines = ["{not json", "null", "[1, 2]", json.dumps(GOOD) + " {}", "42", '"text"', "true"]
    message = _refusal(_write(tmp_path, "bad.jsonl", _jsonl(*lines)))
    assert "none of its 7 lines holds a usable row" in message
    assert "line 1: is not valid JSON" in message and "line 2: is null" in message
    assert "line 3: is a JSON array" in message and "and 2 more" in message


# --- binary content: refused on every path, by the same rules as the upload check --------------


def test_gzip_compressed_jsonl_is_refused(tmp_path: Path) -> None:
    """Old: the engine/CLI path decompressed it silently (the upload check refused it)."""
    path = _write(tmp_path, "data.jsonl", gzip.compress(_jsonl(json.dumps(GOOD)).encode()))
    message = _refusal(path)
    assert "gzip-compressed" in message and "decompress it first" in message


def test_nul_bytes_in_csv_are_refused_with_the_line(tmp_path: Path) -> None:
    """Old: the engine/CLI path read 'a\\x00' as a prompt (the upload check refused it)."""
    path = _write(tmp_path, "nul.csv", b"prompt,completion\nfine,ok\na\x00,b\n")
    message = _refusal(path)
    assert "binary data" in message and "NUL byte on line 3" in message


def test_csv_values_stay_text(tmp_path: Path) -> None:
    """Old: pyarrow typed an all-number column as integers, so every completion '4' was rejected
    as 'empty completion'. The csv module keeps every value as written."""
    path = _write(tmp_path, "n.csv", "prompt,completion\n2 + 2?,4\n3 + 3?,6\n")
    _, convs, bad = load_conversations(str(path))
    assert not bad and [c.messages[1]["content"] for c in convs] == ["4", "6"]


def test_json_shapes(tmp_path: Path) -> None:
    """An array (bad elements reported as rows), an object holding one list of rows, JSON Lines
    saved as .json; a lone row is one row."""
    arr = _write(tmp_path, "a.json", json.dumps([GOOD, None, GOOD]))
    _, convs, bad = load_conversations(str(arr))
    assert [c.line for c in convs] == [1, 3] and [(b.line, b.reason) for b in bad] == [(2, "is null, not a JSON object {...}")]
    assert len(read_rows(str(_write(tmp_path, "w.json", json.dumps({"data": [GOOD, GOOD]}))))[1]) == 2
    assert len(read_rows(str(_write(tmp_path, "l.json", _jsonl(json.dumps(GOOD), json.dumps(GOOD)))))[1]) == 2
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert read_rows(str(_write(tmp_path, "one.json", json.dumps(chat))))[1] == [chat]


def test_overlong_line_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line over MAX_LINE_BYTES is reported, never held whole; the lines after it still count."""
    from kestrel.data import reader

    monkeypatch.setattr(reader, "MAX_LINE_BYTES", 1000)
    long = json.dumps({"prompt": "x" * 5000, "completion": "y"})
    _, convs, bad = load_conversations(str(_write(tmp_path, "l.jsonl", _jsonl(json.dumps(GOOD), long, json.dumps(GOOD)))))
    assert [c.line for c in convs] == [1, 3]
    assert [b.line for b in bad] == [2] and "over the 1000 bytes limit" in bad[0].reason


# --- Parquet: read in a child, so a native crash becomes a message ------------------------------


def test_damaged_parquet_is_a_message_naming_the_file(tmp_path: Path) -> None:
    """Cut short, a PAR1 frame around junk, 40 flipped bytes: each a DatasetError naming the file,
    from the frame check or from the child's one-line reason. (The old reader also refused these;
    this guards the new child path, and passes on the old code.)"""
    good = tmp_path / "good.parquet"
    pd.DataFrame([GOOD] * 3).to_parquet(good)
    data = good.read_bytes()
    rng = random.Random(1)
    damaged = {"cut.parquet": data[: len(data) // 2], "junk.parquet": b"PAR1" + b"\x00" * 64 + b"PAR1"}
    flipped = bytearray(data)
    for i in rng.sample(range(4, len(data) - 4), 40):
        flipped[i] ^= 0xFF
    damaged["flipped.parquet"] = bytes(flipped)
    for name, blob in damaged.items():
        _refusal(_write(tmp_path, name, blob))


def test_a_crash_in_the_parquet_child_becomes_a_dataset_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child killed by SIGSEGV (as pyarrow was on the JSON above) is a message, not a dead studio."""
    from kestrel.data import reader

    crash = _write(tmp_path, "crash.py", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.setattr(reader, "PARQUET_CHILD", crash)
    path = tmp_path / "fine.parquet"
    pd.DataFrame([GOOD]).to_parquet(path)
    message = _refusal(path)
    assert "crashed" in message and "SIGSEGV" in message


# --- fuzz: 200 malformed variants of a valid sample --------------------------------------------


@pytest.mark.timeout(60)
def test_fuzz_every_outcome_is_rows_or_a_message_naming_the_file(tmp_path: Path) -> None:
    """200 seeded variants through read_rows and load_conversations: each gives rows or a
    DatasetError naming the file; any other exception (or a crash, or a hang) fails. Old: the
    floods and nulls segfaulted, bad UTF-8 raised UnicodeDecodeError."""
    rng = random.Random(20260430)
    failures = []
    for i in range(200):
        ext = rng.choice([".jsonl", ".jsonl", ".json", ".csv"])
        data, kinds = dataset_base(ext), []
        for _ in range(rng.choice([1, 1, 2, 3])):
            kind, data = dataset_mutant(rng, data)
            kinds.append(kind)
        path = _write(tmp_path, f"v{i:03d}{ext}", data)
        try:
            _, rows = read_rows(str(path))
            assert rows and all(isinstance(r, dict) for r in rows)
            load_conversations(str(path))
        except DatasetError as exc:
            if path.name not in str(exc):
                failures.append(f"{path.name} {kinds}: message without the file name: {exc}")
        except Exception as exc:  # noqa: BLE001 - the point: nothing but DatasetError gets out
            failures.append(f"{path.name} {kinds}: {type(exc).__name__}: {str(exc)[:200]}")
    assert not failures, "\n".join(failures)
