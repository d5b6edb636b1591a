"""Datasets tab handlers: format detection, column mapping, validation report with line numbers,
preview, token preview (trained / masked / cut), histogram, and clear messages for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import gradio as gr
import pytest

from kestrel import jobs
from kestrel.paths import SAMPLE_DATASETS
from kestrel.studio.handlers import datasets as ds
from tests.studio.helpers import error_text


def _upload(tmp_path: Path, name: str, text: str) -> dict:
    path = tmp_path / "up" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return ds.upload_dataset(str(path), max_mb=10)


def test_sample_dataset_one_click(kestrel_home: Path) -> None:
    out = ds.open_dataset(str(SAMPLE_DATASETS / "arithmetic_chat.jsonl"))
    assert out["state"]["format"] == "messages"
    assert out["format"]["value"] == "messages"
    assert len(out["preview"]) == 10 and out["preview"]["line"].tolist()[:2] == [1, 2]
    assert out["report"].empty
    hist = out["histogram"]["value"]
    assert hist["rows"].sum() == 800  # every row measured
    assert out["histogram"]["sort"] == list(hist["tokens"]) and hist["tokens"].iloc[0].startswith("2")
    assert out["col_messages"]["visible"] and not out["col_prompt"]["visible"]
    assert "800 usable" in out["summary"]
    registered = jobs.list_datasets()
    assert [d.format for d in registered] == ["messages"] and registered[0].rows == 800


def test_upload_with_bad_rows_reports_line_numbers(tmp_path: Path, kestrel_home: Path) -> None:
    rows = [{"prompt": "What is 1 + 1?", "completion": "2"}, {"prompt": "", "completion": "x"},
            {"prompt": "Say hi", "completion": "hi"}, {"prompt": "no answer", "completion": "  "}]
    out = _upload(tmp_path, "../../my data.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    stored = Path(out["state"]["path"])
    assert stored.parent == kestrel_home / "datasets" and stored.name == "my_data.jsonl"
    assert out["state"]["format"] == "prompt_completion"
    assert out["report"]["line"].tolist() == [2, 4]
    assert out["report"]["reason"].tolist() == ["empty prompt", "empty completion"]
    assert out["row"]["minimum"] == 1 and out["row"]["maximum"] == 3


def test_unknown_columns_then_mapping(tmp_path: Path) -> None:
    text = "question,reply\nWhat is 2 + 2?,4\nCapital of France?,Paris\n"
    out = _upload(tmp_path, "qa.csv", text)
    assert "no known format matches" in out["status"]  # a notice, with the preview still shown
    assert list(out["preview"].columns) == ["line", "question", "reply"]
    assert out["preview"]["line"].tolist() == [2, 3]  # csv line 1 is the header
    cols = {r: None for r in ds.roles()} | {"prompt": "question", "completion": "reply"}
    mapped = ds.apply_mapping(out["state"], "prompt_completion", "demo", *[cols[r] for r in ds.roles()])
    assert mapped["state"]["format"] == "prompt_completion"
    assert mapped["state"]["columns"] == {"prompt": "question", "completion": "reply"}
    assert mapped["report"].empty and "2 usable" in mapped["summary"]


def test_histogram_buckets_in_length_order() -> None:
    frame = ds.histogram_frame([3, 5, 40, 41, 100], bins=4)
    assert list(frame["tokens"]) == ["3-27", "28-52", "53-77", "78-102"]
    assert list(frame["rows"]) == [2, 2, 0, 1]
    assert list(ds.histogram_frame([7, 7, 8])["tokens"]) == ["7", "8"]


def test_token_preview_marks_trained_masked_and_cut() -> None:
    state = ds.open_dataset(str(SAMPLE_DATASETS / "words_prompt_completion.csv"))["state"]
    full = ds.token_preview(state, 2, "demo", 1024, True)
    labels = [label for _, label in full["tokens"]]
    assert labels[0] == "masked" and "trained" in labels and "cut off" not in labels
    assert labels[-1] == "trained"  # the end-of-turn token is learned
    text = "".join(t for t, _ in full["tokens"])
    assert "Reverse the word. pencil" in text and "licnep" in text
    cut = ds.token_preview(state, 2, "demo", 10, True)
    assert [label for _, label in cut["tokens"]][10:] == ["cut off"] * (len(cut["tokens"]) - 10)
    assert "cut off" in cut["token_summary"] and "max_seq_length=10" in cut["token_summary"]
    everything = ds.token_preview(state, 2, "demo", 1024, False)
    assert {label for _, label in everything["tokens"]} == {"trained"}


def test_token_preview_of_a_missing_row() -> None:
    state = ds.open_dataset(str(SAMPLE_DATASETS / "words_prompt_completion.csv"))["state"]
    with pytest.raises(gr.Error) as excinfo:
        ds.token_preview(state, 9999, "demo", 128, True)
    assert "no usable row at line 9999" in error_text(excinfo)


@pytest.mark.parametrize("name, data, words", [
    ("fake.jsonl", "\x00\x01binary", "binary data"),
    ("broken.jsonl", '{"prompt": "a", "completion"\n', "could not read"),
    ("empty.csv", "", "is empty"),
])
def test_bad_files_get_a_message_and_are_not_kept(tmp_path: Path, kestrel_home: Path, name: str, data: str,
                                                   words: str) -> None:
    with pytest.raises(gr.Error) as excinfo:
        _upload(tmp_path, name, data)
    assert words in error_text(excinfo)
    assert not any((kestrel_home / "datasets").glob("*.*")) and jobs.list_datasets() == []


def test_deeply_nested_upload_is_refused_and_the_studio_lives(tmp_path: Path, kestrel_home: Path) -> None:
    """Issue 30: a 20 KB file nested 10,000 deep passed the upload check and segfaulted the studio
    inside pyarrow. Now the reader refuses it, naming the file and the line, and drops the copy."""
    with pytest.raises(gr.Error) as excinfo:
        _upload(tmp_path, "deep.jsonl", '{"messages": ' + "[" * 10_000 + "]" * 10_000 + "}\n")
    message = error_text(excinfo)
    assert "deep.jsonl" in message and "line 1: is nested deeper than 64 levels" in message
    assert not any((kestrel_home / "datasets").glob("*.*")) and jobs.list_datasets() == []


def test_one_broken_line_is_reported_not_fatal(tmp_path: Path) -> None:
    """Issue 29: one cut-short line rejected the whole JSONL ('could not read … An error occurred
    while generating the dataset'). Now it is a line of the validation report, the rest is used."""
    good = json.dumps({"prompt": "What is 1 + 1?", "completion": "2"})
    out = _upload(tmp_path, "cut.jsonl", "\n".join([good, good[:25], good, "null", good]) + "\n")
    assert out["state"]["format"] == "prompt_completion" and "3 usable" in out["status"]
    assert out["report"]["line"].tolist() == [2, 4]
    assert "cut short" in out["report"]["reason"][0] and out["report"]["reason"][1] == "is null, not a JSON object {...}"
    assert out["preview"]["line"].tolist() == [1, 3, 5]  # each row shown with its own line


def test_no_usable_row_is_a_notice_with_the_preview(tmp_path: Path) -> None:
    out = _upload(tmp_path, "x.jsonl", '{"prompt": "", "completion": ""}\n')
    assert "none of its 1 rows is usable" in out["status"] and "line 1: empty prompt" in out["status"]
    assert len(out["preview"]) == 1
    assert jobs.list_datasets() == []  # registered only once usable


def test_dataset_deleted_on_disk() -> None:
    with pytest.raises(gr.Error) as excinfo:
        ds.token_preview({"path": "/nowhere/gone.jsonl", "format": "auto"}, 1, "demo", 128, True)
    assert "does not exist any more" in error_text(excinfo)
