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
    # Buckets come in length order; no `sort` in the update: changing it with the value made the
    # page draw the previous dataset's histogram (tests/studio/test_browser_datasets.py).
    assert "sort" not in out["histogram"] and hist["tokens"].iloc[0].startswith("2")
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


def _map(state: dict, fmt: str, **mapping: str) -> dict:
    cols = {r: None for r in ds.roles()} | mapping
    return ds.apply_mapping(state, fmt, "demo", *[cols[r] for r in ds.roles()])


def test_unknown_columns_then_mapping(tmp_path: Path) -> None:
    text = "q,a\nWhat is 2 + 2?,4\nCapital of France?,Paris\n"
    out = _upload(tmp_path, "qa.csv", text)
    assert "no known format matches" in out["status"]  # a notice, with the preview still shown
    assert out["tokens"] is None and out["token_summary"] == "" and not out["state"]["usable"]  # no stale rows
    from kestrel.studio.handlers import train

    assert isinstance(train.use_dataset(out["state"], {})["dataset"], type(gr.skip()))  # the Train form keeps its own
    assert list(out["preview"].columns) == ["line", "q", "a"]
    assert out["preview"]["line"].tolist() == [2, 3]  # csv line 1 is the header
    mapped = _map(out["state"], "prompt_completion", prompt="q", completion="a")
    assert mapped["state"]["format"] == "prompt_completion"
    assert mapped["state"]["columns"] == {"prompt": "q", "completion": "a"}
    assert mapped["report"].empty and "2 usable" in mapped["summary"]


def test_a_mapping_is_kept_with_the_dataset(tmp_path: Path, fake_engine: None) -> None:
    """Issue 29: a CSV mapped to prompt/completion was listed as prompt_completion, but Open detected
    again and failed, and the Train tab's run failed with "no known format". The mapping is saved
    with the dataset in the job store and every later use applies it."""
    from kestrel.studio.handlers import train

    out = _upload(tmp_path, "qa.csv", "q,a\nWhat is 2 + 2?,4\nCapital of France?,Paris\n")
    path = _map(out["state"], "prompt_completion", prompt="q", completion="a")["state"]["path"]
    assert jobs.saved_mapping(path) == ("prompt_completion", {"prompt": "q", "completion": "a"})
    reopened = ds.open_dataset(path)  # what Open does: no format, no columns given
    assert reopened["state"]["format"] == "prompt_completion" and "2 usable" in reopened["status"]
    assert reopened["col_prompt"]["value"] == "q" and "columns saved with the dataset" in reopened["summary"]
    picked = train.pick_dataset(path, None, {})  # the Train tab's dropdown, the Datasets tab elsewhere
    assert picked["dataset_format"] == "prompt_completion" and picked["extra"]["columns"] == {"prompt": "q",
                                                                                              "completion": "a"}
    job = jobs.get_job(jobs.submit({"model": "demo", "dataset": path, "max_steps": 1}, start=False))
    assert job.config["dataset_format"] == "prompt_completion"  # a run that named neither gets it too
    assert job.config["columns"] == {"prompt": "q", "completion": "a"}
    failed = _map(reopened["state"], "auto")  # a failed try keeps what was saved
    assert "no known format" in failed["status"] and jobs.saved_mapping(path) is not None
    Path(path).write_text("question,answer\nWhat is 1 + 1?,2\n")  # the file edited: other columns
    replaced = ds.open_dataset(path)
    assert replaced["state"]["format"] == "prompt_completion" and "1 usable" in replaced["status"]
    assert jobs.saved_mapping(path) is None  # the old mapping no longer fits: detected, and forgotten


def test_common_column_names_are_mapped_without_asking(tmp_path: Path) -> None:
    out = _upload(tmp_path, "qa.csv", "Question,Answer\nWhat is 2 + 2?,4\n")
    assert out["state"]["format"] == "prompt_completion" and out["state"]["columns"] == {}
    assert (out["col_prompt"]["value"], out["col_completion"]["value"]) == ("Question", "Answer")


def test_token_preview_decodes_multibyte_characters_whole(tmp_path: Path) -> None:
    """Issue 29: the preview decoded one token at a time, so a character that byte-level BPE splits
    over several tokens showed as U+FFFD although the tokenizer round-trips it."""
    from kestrel.studio.handlers.common import tokenizer_for

    text = "It is 25°C, 3×4 = 12, −1 🙂 日本語"
    tokenizer = tokenizer_for("demo")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert "\ufffd" in "".join(tokenizer.decode([i]) for i in ids)  # the demo tokenizer splits them
    out = _upload(tmp_path, "units.jsonl", json.dumps({"prompt": "Weather?", "completion": text}) + "\n")
    pieces = ds.token_preview(out["state"], 1, "demo", 1024, True)["tokens"]
    assert not any("\ufffd" in piece for piece, _ in pieces)
    assert text in "".join(piece for piece, _ in pieces)
    trained = "".join(piece for piece, label in pieces if label == "trained")
    assert text in trained and "Weather?" not in trained
    cut = ds.token_preview(out["state"], 1, "demo", len(pieces) // 2, True)["tokens"]  # a cut inside the text
    assert "".join(piece for piece, _ in cut) == "".join(piece for piece, _ in pieces)


def test_truncation_warning_offers_a_length_that_fits(tmp_path: Path) -> None:
    rows = [{"prompt": "Say it", "completion": " ".join(["word"] * n)} for n in [5] * 80 + [60] * 20]
    out = _upload(tmp_path, "long.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    lengths = ds.measured_lengths(out["state"], "demo")
    short, longest = min(lengths), max(lengths)
    note = ds.token_preview(out["state"], 1, "demo", short + 5, True)["truncation"]
    assert "20% of rows (20 of 100) are longer than max_seq_length" in note
    from kestrel.data.lengths import fit_length

    assert f"max_seq_length={fit_length(lengths):,} fits 95%" in note and fit_length(lengths) >= longest
    assert ds.token_preview(out["state"], 1, "demo", longest, True)["truncation"] == ""
    from kestrel.studio.handlers import train  # the Train tab shows the same warning under its estimate
    from tests.studio.helpers import form

    extra, values = form(dataset=out["state"]["path"], max_seq_length=short + 5)
    assert note in train.preview(extra, *values)["vram"]


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
