"""Dataset reading, format detection, response masking and packing."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kestrel.data import BatchPlan, detect_format, load_conversations, tokenize_all
from kestrel.data.collate import pack_rows
from kestrel.data.formats import Conversation, detect, resolve_columns
from kestrel.data.tokenize import IGNORE, tokenize_conversation
from kestrel.errors import DatasetError

ROWS = {
    "messages": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    "alpaca": {"instruction": "hi", "input": "", "output": "hello"},
    "prompt_completion": {"prompt": "hi", "completion": "hello"},
    "text": {"text": "hello world"},
}


@pytest.mark.parametrize("fmt", list(ROWS))
@pytest.mark.parametrize("ext", [".jsonl", ".json", ".csv", ".parquet"])
def test_each_format_in_each_file_type(tmp_path, fmt: str, ext: str) -> None:
    if ext == ".csv" and fmt in ("messages", "sharegpt"):
        pytest.skip("nested lists do not fit in a CSV cell")
    rows = [ROWS[fmt]] * 3
    path = tmp_path / f"data{ext}"
    if ext == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif ext == ".json":
        path.write_text(json.dumps(rows))
    elif ext == ".csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pd.DataFrame(rows).to_parquet(path)
    found, convs, bad = load_conversations(str(path))
    assert found == fmt and len(convs) == 3 and not bad
    if fmt == "text":
        assert convs[0].text == "hello world"
    else:
        assert convs[0].messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_unknown_format_lists_columns_and_formats() -> None:
    with pytest.raises(DatasetError) as err:
        detect_format([{"q": "a", "a": "b"}], source="q.jsonl")
    message = str(err.value)
    assert "q.jsonl" in message and "[a, q]" in message and "prompt_completion (prompt, completion)" in message


@pytest.mark.parametrize(("row", "methods"), [
    ({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "dpo, orpo or simpo"),
    ({"chosen": [{"role": "user", "content": "hi"}], "rejected": []}, "dpo, orpo or simpo"),
    ({"prompt": "2+2?", "completion": "4", "label": True}, "kto"),
])
def test_preference_rows_for_supervised_training_name_the_methods_that_take_them(row: dict, methods: str) -> None:
    with pytest.raises(DatasetError) as err:
        detect_format([row], source="prefs.jsonl")
    message = str(err.value)
    assert message.startswith("prefs.jsonl: ") and f"method {methods} trains" in message and "no known format" not in message


def test_a_label_column_that_is_not_true_or_false_stays_supervised_data() -> None:
    assert detect_format([{"prompt": "2+2?", "completion": "4", "label": "arithmetic"}]) == "prompt_completion"


def test_column_mapping(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "a", "a": "b"}) + "\n")
    fmt, convs, _ = load_conversations(str(path), columns={"prompt": "q", "completion": "a"})
    assert fmt == "prompt_completion" and convs[0].messages[1]["content"] == "b"


@pytest.mark.parametrize("columns, fmt, mapping", [
    (("question", "answer"), "prompt_completion", {"prompt": "question", "completion": "answer"}),
    (("Input", "Output"), "prompt_completion", {"prompt": "Input", "completion": "Output"}),
    (("query", "reply"), "prompt_completion", {"prompt": "query", "completion": "reply"}),
    (("prompt", "response"), "prompt_completion", {"prompt": "prompt", "completion": "response"}),
    (("instruction", "response"), "alpaca", {"instruction": "instruction", "output": "response"}),
    (("instruction", "context", "response"), "alpaca", {"instruction": "instruction", "input": "context",
                                                        "output": "response"}),
    (("context", "reply", "system_prompt"), "prompt_completion", {"prompt": "context", "completion": "reply",
                                                                  "system": "system_prompt"}),
])
def test_common_column_names_need_no_mapping(tmp_path, columns, fmt, mapping) -> None:
    path = tmp_path / "d.csv"
    path.write_text(",".join(columns) + "\n" + ",".join(f"v{i}" for i in range(len(columns))) + "\n")
    found, convs, bad = load_conversations(str(path))
    assert found == fmt and not bad
    assert detect([dict.fromkeys(columns, "x")]) == (fmt, mapping)
    assert convs[0].messages[-1]["content"] == f"v{columns.index(mapping.get('completion') or mapping['output'])}"


def test_an_explicit_mapping_wins_and_a_column_serves_one_role() -> None:
    row = {"question": "x", "answer": "y", "input": "z"}
    assert detect([row], {"prompt": "input"}) == ("prompt_completion", {"prompt": "input", "completion": "answer"})
    assert resolve_columns(["answer"], "prompt_completion", {"completion": "answer"}) is None  # no prompt left
    assert resolve_columns(["q"], "prompt_completion", {"prompt": "gone", "completion": "q"}) is None


def test_bad_rows_reported_with_line_numbers(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    good = {"prompt": "a", "completion": "b"}
    lines = [good, {"prompt": "", "completion": "b"}, good, {"prompt": "a", "completion": None}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    _, convs, bad = load_conversations(str(path))
    assert len(convs) == 2
    assert [(b.line, b.reason) for b in bad] == [(2, "empty prompt"), (4, "empty completion")]


@pytest.mark.parametrize(
    "content, needle",
    [(None, "does not exist"), ("", "is empty"), ("{not json", "could not read")],
)
def test_unreadable_files(tmp_path, content, needle) -> None:
    path = tmp_path / "d.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DatasetError, match=needle):
        load_conversations(str(path))


def test_wrong_extension(tmp_path) -> None:
    path = tmp_path / "d.txt"
    path.write_text("x")
    with pytest.raises(DatasetError, match="unsupported extension '.txt'"):
        load_conversations(str(path))


def test_responses_only_masks_the_prompt(demo_tokenizer) -> None:
    conv = Conversation(messages=[{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}])
    sample = tokenize_conversation(demo_tokenizer, conv, 256, responses_only=True)
    trained = demo_tokenizer.decode([t for t, l in zip(sample.input_ids, sample.labels) if l != IGNORE])
    assert trained == "4<|im_end|>\n"
    full = tokenize_conversation(demo_tokenizer, conv, 256, responses_only=False)
    assert full.labels == full.input_ids


def test_truncation_counted_and_mostly_masked_rejected(demo_tokenizer) -> None:
    long_prompt = " ".join(["word"] * 200)
    convs = [Conversation(messages=[{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "ok"}])] * 3
    with pytest.raises(DatasetError, match="have no trained tokens.*Raise max_seq_length"):
        tokenize_all(demo_tokenizer, convs, 64, True)
    short = [Conversation(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": long_prompt}])]
    data = tokenize_all(demo_tokenizer, short * 2, 64, True)
    assert data.truncated == 2 and all(len(s.input_ids) == 64 for s in data.samples)


def test_packing_restarts_positions_and_masks_boundaries(demo_tokenizer) -> None:
    _, convs, _ = load_conversations("arithmetic_chat")
    data = tokenize_all(demo_tokenizer, convs[:40], 128, True)
    rows = pack_rows(data.samples, 128)
    assert sum(len(r) for r in rows) == 40 and all(sum(len(s.input_ids) for s in r) <= 128 for r in rows)
    plan = BatchPlan(data.samples, len(rows), True, 128, demo_tokenizer.pad_token_id, seed=0)
    batch = plan.batch(0, 0)
    pos = batch.position_ids[0].tolist()
    starts = [i for i, p in enumerate(pos) if p == 0]
    assert len(starts) >= 2
    assert all(batch.labels[0, s] == IGNORE for s in starts)
    assert batch.attention_mask is None
    assert batch.tokens == sum(len(s.input_ids) for s in data.samples)  # every row, no padding counted
