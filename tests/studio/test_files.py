"""Uploads are copied inside KESTREL_HOME under safe names; bad files are refused with a reason."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from kestrel.errors import DatasetError
from kestrel.studio import files

LINE = b'{"prompt": "a", "completion": "b"}\n'


@pytest.mark.parametrize("name, expected", [
    ("data.jsonl", "data.jsonl"),
    ("../../../etc/passwd.jsonl", "passwd.jsonl"),
    ("..\\..\\Windows\\evil.csv", "evil.csv"),
    ("C:\\Users\\me\\My Data (1).JSONL", "My_Data_1.jsonl"),
    (".bashrc.json", "bashrc.json"),
    ("..", "dataset"),
    ("", "dataset"),
    ("données été.csv", "donnees_ete.csv"),
    ("a\x00b\nc.jsonl", "a_b_c.jsonl"),
    ("x" * 300 + ".jsonl", "x" * 80 + ".jsonl"),
])
def test_safe_filename(name: str, expected: str) -> None:
    assert files.safe_filename(name) == expected


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / "incoming" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_crafted_name_stays_inside_datasets(tmp_path: Path, kestrel_home: Path) -> None:
    src = _write(tmp_path, "x.jsonl", LINE)
    stored = files.store_upload(src, "../../outside.jsonl", 1 << 20)
    assert stored.parent == (kestrel_home / "datasets").resolve() or stored.parent == kestrel_home / "datasets"
    assert stored.name == "outside.jsonl" and stored.read_bytes() == LINE
    assert not (kestrel_home.parent / "outside.jsonl").exists()


def test_same_name_new_content_never_overwrites(tmp_path: Path) -> None:
    first = files.store_upload(_write(tmp_path, "d.jsonl", LINE), "d.jsonl", 1 << 20)
    again = files.store_upload(_write(tmp_path, "d.jsonl", LINE), "d.jsonl", 1 << 20)
    other = files.store_upload(_write(tmp_path, "d.jsonl", LINE * 2), "d.jsonl", 1 << 20)
    assert again == first  # same bytes: reuse
    assert other != first and other.name == "d-1.jsonl"
    assert first.read_bytes() == LINE and other.read_bytes() == LINE * 2


@pytest.mark.parametrize("name, data, words", [
    ("empty.jsonl", b"", "is empty"),
    ("pic.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00\x00IHDR", "binary data"),
    ("table.parquet", b"id,text\n1,hi\n", "not a Parquet file"),
    ("notes.json", b"hello there\n", "does not start like JSON"),
    ("model.bin", LINE, "unsupported file type"),
    # issue 30: the reader's own checks (old: "binary data", no word of gzip; a cut Parquet file passed)
    ("data.jsonl", gzip.compress(LINE, mtime=0), "is gzip-compressed.*decompress it first"),
    ("cut.parquet", b"PAR1" + b"\x15" * 40, "not a complete Parquet file"),
])
def test_bad_uploads_are_refused(tmp_path: Path, kestrel_home: Path, name: str, data: bytes, words: str) -> None:
    with pytest.raises(DatasetError, match=words):
        files.store_upload(_write(tmp_path, name, data), name, 1 << 20)
    assert not any((kestrel_home / "datasets").glob("*"))


def test_size_limit(tmp_path: Path) -> None:
    src = _write(tmp_path, "big.jsonl", LINE * 2000)
    with pytest.raises(DatasetError, match="over the upload limit"):
        files.store_upload(src, "big.jsonl", 1024)
