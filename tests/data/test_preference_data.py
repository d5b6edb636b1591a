"""Preference datasets: every paired layout (text, messages, UltraFeedback-style conversations,
Anthropic HH transcripts) and KTO's unpaired rows become the same prompt / answer messages; bad
rows are reported with their line and why; tokenized answers carry no prompt token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel.data.preference import load_preferences
from kestrel.data.preference_tokens import tokenize_preferences
from kestrel.errors import DatasetError

Q = "What is 2 + 2?"
USER = [{"role": "user", "content": Q}]
GOOD, BAD = [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]


def _write(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


LAYOUTS = {
    "text": {"prompt": Q, "chosen": "4", "rejected": "5"},
    "messages": {"prompt": USER, "chosen": GOOD, "rejected": BAD},
    "conversation": {"prompt": Q, "chosen": USER + GOOD, "rejected": USER + BAD},  # UltraFeedback-style
    "transcript": {"chosen": f"\n\nHuman: {Q}\n\nAssistant: 4", "rejected": f"\n\nHuman: {Q}\n\nAssistant: 5"},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_paired_layouts_give_the_same_rows(tmp_path: Path, layout: str) -> None:
    data = load_preferences(_write(tmp_path, [LAYOUTS[layout]] * 2), "paired")
    assert data.kind == "paired" and data.layout == layout and not data.bad
    row = data.rows[0]
    assert (row.prompt, row.chosen, row.rejected) == (USER, GOOD, BAD)
    assert [r.line for r in data.rows] == [1, 2]


def test_hh_multi_turn_shares_the_conversation_up_to_the_last_answer(tmp_path: Path) -> None:
    shared = f"\n\nHuman: {Q}\n\nAssistant: 4\n\nHuman: Sure?"
    data = load_preferences(_write(tmp_path, [{"chosen": shared + "\n\nAssistant: Yes.",
                                               "rejected": shared + "\n\nAssistant: No, 5."}]), "paired")
    row = data.rows[0]
    assert [m["role"] for m in row.prompt] == ["user", "assistant", "user"]
    assert row.chosen[0]["content"] == "Yes." and row.rejected[0]["content"] == "No, 5."


def test_bad_rows_are_reported_with_line_and_reason(tmp_path: Path) -> None:
    rows = [
        LAYOUTS["text"],
        {"prompt": Q, "chosen": "", "rejected": "5"},
        {"prompt": Q, "chosen": "4", "rejected": "4"},
        {"chosen": USER + GOOD, "rejected": [{"role": "user", "content": "other"}] + BAD},
        {"chosen": "4", "rejected": "5"},
        {"prompt": Q, "chosen": USER + GOOD, "rejected": "5"},
        {"prompt": Q, "chosen": [{"role": "robot", "content": "4"}], "rejected": BAD},
    ]
    data = load_preferences(_write(tmp_path, rows), "paired")
    assert len(data.rows) == 1
    reasons = {issue.line: issue.reason for issue in data.bad}
    assert reasons == {
        2: "empty chosen",
        3: "chosen and rejected are the same answer",
        4: "chosen and rejected differ before their last assistant turn; they must share the conversation up to "
           "the answer",
        5: "no `prompt`: answers alone need the prompt they answer",
        6: "one of chosen and rejected is a whole conversation and the other only an answer",
        7: "chosen message 0 needs a role (system, user, assistant) and text content",
    }


def test_kto_rows_and_labels(tmp_path: Path) -> None:
    rows = [{"prompt": Q, "completion": "4", "label": True}, {"prompt": USER, "completion": BAD, "label": 0},
            {"prompt": Q, "completion": "4", "label": "false"}, {"prompt": Q, "completion": "4", "label": "maybe"}]
    data = load_preferences(_write(tmp_path, rows), "unpaired", system_prompt="Be brief.")
    assert [r.label for r in data.rows] == [True, False, False]
    assert data.rows[1].chosen == BAD and data.rows[0].prompt[0] == {"role": "system", "content": "Be brief."}
    assert [(b.line, b.reason) for b in data.bad] == [(4, "label must be true or false (or 1 / 0), got 'maybe'")]


def test_the_wrong_kind_names_the_method_to_use(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="unpaired KTO data .* use method kto"):
        load_preferences(_write(tmp_path, [{"prompt": Q, "completion": "4", "label": True}]), "paired")
    with pytest.raises(DatasetError, match="use method dpo, orpo or simpo"):
        load_preferences(_write(tmp_path, [LAYOUTS["text"]]), "unpaired")
    with pytest.raises(DatasetError, match=r"needs the columns chosen, rejected .* it has \[messages\]"):
        load_preferences(_write(tmp_path, [{"messages": USER + GOOD}]), "paired")


def test_columns_rename(tmp_path: Path) -> None:
    path = _write(tmp_path, [{"question": Q, "better": "4", "worse": "5"}])
    data = load_preferences(path, "paired", columns={"prompt": "question", "chosen": "better", "rejected": "worse"})
    assert (data.rows[0].chosen, data.rows[0].rejected) == (GOOD, BAD)


def test_tokens_mask_the_prompt_and_fit_max_len(tmp_path: Path, demo_tokenizer) -> None:
    long = {"prompt": Q, "chosen": "4 " * 40, "rejected": "5"}
    huge = {"prompt": "x " * 200, "chosen": "4", "rejected": "5"}
    data = load_preferences(_write(tmp_path, [LAYOUTS["messages"], long, huge]), "paired")
    samples, report = tokenize_preferences(demo_tokenizer, data.rows, max_len=32)
    assert len(samples) == 2 and report.truncated == 1 and [b.line for b in report.skipped] == [3]
    first = samples[0]
    rendered = demo_tokenizer.apply_chat_template(USER + GOOD, tokenize=False)
    assert demo_tokenizer.decode(first.prompt + first.answers[0]) == rendered  # prompt + answer = the chat
    assert demo_tokenizer.decode(first.answers[0]) == "4<|im_end|>\n"  # the answer alone, end of turn included
    assert all(len(s.prompt) + len(a) <= 32 for s in samples for a in s.answers)
