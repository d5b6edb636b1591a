"""The studio and preference training: the Datasets tab recognises preference files and shows
chosen vs rejected side by side (KTO: completion and label), with the skipped rows and a token
view; the Train form offers the methods, their settings and a DPO preset; the memory estimate
counts chosen and rejected rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gradio as gr
import pytest
import yaml

from kestrel.paths import SAMPLE_DATASETS
from kestrel.studio import strings as S
from kestrel.studio.handlers import datasets, train
from kestrel.training.estimate import training_rows
from tests.studio.helpers import error_text, form


def test_preference_pairs_previewed_side_by_side(kestrel_home: Path) -> None:
    path = kestrel_home / "datasets" / "hh.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"chosen": "\n\nHuman: Hi?\n\nAssistant: Hello!", "rejected": "\n\nHuman: Hi?\n\nAssistant: Go away."},
            {"chosen": "\n\nHuman: A\n\nAssistant: B", "rejected": "\n\nHuman: C\n\nAssistant: D"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = datasets.open_dataset(str(path))
    assert out["state"]["preference"] == "paired" and out["state"]["format"] == "auto"
    assert out["state"]["usable"]  # the page previews its tokens and carries it into the Train form
    assert train.use_dataset(out["state"], {})["dataset"] == str(path)
    preview = out["preview"]
    assert list(preview.columns) == ["line", "prompt", "chosen", "rejected"]
    assert preview.iloc[0].tolist() == [1, "Hi?", "Hello!", "Go away."]
    assert out["report"]["line"].tolist() == [2] and "differ before their last assistant turn" in out["report"]["reason"][0]
    assert "preference pairs (transcript; for DPO, ORPO, SimPO)" in out["summary"] and "1 skipped" in out["summary"]
    tokens = datasets.token_preview(out["state"], 1, "demo", 1024)
    text = "".join(t for t, _ in tokens["tokens"])
    assert text.index("Hi?") < text.index("[chosen]") < text.index("Hello!") < text.index("[rejected]")
    assert {label for _, label in tokens["tokens"]} == {S.DS_TOKEN_LABELS["masked"], S.DS_TOKEN_LABELS["trained"], None}


def test_kto_rows_previewed_with_their_labels() -> None:
    out = datasets.open_dataset(str(SAMPLE_DATASETS / "arithmetic_kto.jsonl"))
    assert out["state"]["preference"] == "unpaired"
    preview = out["preview"]
    assert list(preview.columns) == ["line", "prompt", "completion", "label"]
    assert set(preview["label"]) <= set(S.DS_KTO_LABELS.values())
    assert "300 usable" in out["summary"] and "for KTO" in out["status"]


def test_sft_files_keep_their_formats() -> None:
    out = datasets.open_dataset(str(SAMPLE_DATASETS / "words_prompt_completion.csv"))
    assert "preference" not in out["state"] and out["state"]["format"] == "prompt_completion"


def test_dpo_preset_and_preference_fields_make_the_yaml() -> None:
    extra, values = form(seed=7)
    filled = train.apply_preset("dpo", extra, *values)
    assert filled["method"] == "dpo" and filled["dataset"] == "arithmetic_preferences" and filled["seed"] == 0
    assert filled["preference.beta"] == 0.1 and filled["preference.loss_type"] == "sigmoid"
    extra, values = form(method="orpo", dataset="arithmetic_preferences", preference__beta=0.25,
                         preference__finetune="full", preference__loss_type="ipo")
    out = train.preview(extra, *values)
    assert out["status"] == "", out["status"]
    data = yaml.safe_load(out["yaml"])
    assert data["method"] == "orpo" and data["preference"]["beta"] == 0.25 and data["preference"]["finetune"] == "full"
    assert all(m in S.TR_METHODS for m in ("dpo", "orpo", "kto", "simpo"))


def test_memory_estimate_counts_chosen_and_rejected_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    assert training_rows("dpo", "qlora", 2) == ("qlora", 4)
    assert training_rows("kto", "full", 2) == ("full", 2)
    assert training_rows("lora", "full", 2) == ("lora", 2)
    monkeypatch.setattr(train, "_gpu", lambda: ("NVIDIA Test 80GB", 80 * 2**30))

    def peak(**changes) -> float:
        extra, values = form(batch_size=64, max_seq_length=4096, gradient_checkpointing="off", **changes)
        return float(re.search(r"about \*\*([\d.]+) GiB", train.preview(extra, *values)["vram"]).group(1))

    assert peak(method="dpo") > 1.5 * peak(method="lora")  # chosen and rejected rows: twice the activations
    assert peak(method="kto") == peak(method="lora")


def test_qlora_preference_needs_a_gpu() -> None:
    extra, values = form(method="dpo", dataset="arithmetic_preferences", preference__finetune="qlora")
    with pytest.raises(gr.Error) as err:
        train.start_training(extra, *values)
    assert error_text(err) == S.ERR_QLORA_CPU
