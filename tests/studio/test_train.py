"""Train tab handlers: the form is the YAML (shown, downloaded, loaded back), presets, memory
estimate, and Start with every kind of bad input answered by a message."""

from __future__ import annotations

from pathlib import Path

import gradio as gr
import pytest
import yaml

from kestrel import jobs
from kestrel.config import load_config
from kestrel.studio.form import FORM_KEYS
from kestrel.studio.handlers import train
from tests.studio.helpers import error_text, form


def test_form_yaml_round_trip(tmp_path: Path) -> None:
    extra, values = form(max_steps=7, lora__r=4, packing=True, name="my run")
    out = train.preview(extra, *values)
    assert out["status"] == ""
    data = yaml.safe_load(out["yaml"])
    assert data["max_steps"] == 7 and data["lora"]["r"] == 4 and data["packing"] is True
    # The download is the same YAML, and the command line reads it to the same config.
    downloaded = Path(out["download"])
    assert downloaded.read_text() == out["yaml"] and downloaded.name.startswith("my-run-")
    assert load_config(downloaded).to_dict() == data
    back = train.apply_yaml(out["yaml"])
    assert [back[k] for k in FORM_KEYS] == values


def test_keys_without_widgets_survive_the_form() -> None:
    text = "dataset_format: prompt_completion\ncolumns: {prompt: question, completion: reply}\n" \
           "grpo: {rewards: [{name: format_regex, pattern: 'x', weight: 0.5}]}\n"
    filled = train.apply_yaml(text)
    assert filled["extra"]["columns"] == {"prompt": "question", "completion": "reply"}
    assert filled["grpo.rewards"] == [["format_regex", 0.5, "x", "", ""]]  # shown in the rewards table
    again = yaml.safe_load(train.preview(filled["extra"], *[filled[k] for k in FORM_KEYS])["yaml"])
    assert again["columns"] == {"prompt": "question", "completion": "reply"}
    assert again["grpo"]["rewards"][0]["name"] == "format_regex"


def test_grpo_rewards_are_chosen_in_the_form() -> None:
    """The GRPO section's rewards table: rows become `grpo.rewards`, blank rows and cells drop out,
    pandas' NaN for an empty number cell is blank, and a custom reward needs the opt-in box."""
    import pandas as pd

    table = pd.DataFrame([["exact_answer", 2, None, None, None], ["length_penalty", 0.5, "", 12, ""],
                          ["", None, None, None, None], ["format_regex", None, r"<answer>\d+</answer>", None, None]],
                         columns=["name", "weight", "pattern", "target_length", "path"])
    extra, values = form(method="grpo", dataset="arithmetic_prompts", **{"grpo__rewards": table})
    out = train.preview(extra, *values)
    assert out["status"] == "", out["status"]
    rewards = yaml.safe_load(out["yaml"])["grpo"]["rewards"]
    assert [(r["name"], r["weight"]) for r in rewards] == [("exact_answer", 2.0), ("length_penalty", 0.5),
                                                            ("format_regex", 1.0)]
    assert rewards[1]["target_length"] == 12 and rewards[2]["pattern"] == r"<answer>\d+</answer>"
    extra, values = form(method="grpo", **{"grpo__rewards": [["length_penalty", 1, "", 7.5, ""]]})
    assert "row 1: target_length 7.5 is not a whole number" in train.preview(extra, *values)["status"]
    extra, values = form(method="grpo", dataset="arithmetic_prompts",
                         **{"grpo__rewards": [["custom", 1, "", "", "/tmp/reward.py"]]})
    with pytest.raises(gr.Error) as excinfo:
        train.start_training(extra, *values)
    assert "allow_custom_rewards" in error_text(excinfo)


def test_load_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: demo\nmax_steps: 3\nlearning_rate: 0.01\n")
    filled = train.load_yaml_file(str(path))
    assert filled["max_steps"] == 3 and filled["learning_rate"] == 0.01 and filled["model_source"] == "demo"


@pytest.mark.parametrize("text, words", [
    ("bogus_key: 1", "unknown config key bogus_key"),
    ("lora: {rank: 8}", "unknown config key lora.rank"),
    ("max_steps: -3", "max_steps must be at least 1"),
    ("learning_rate: 5", "learning_rate must be in (0, 1)"),
    ("batch_size: many", "batch_size"),
    ("[1, 2]", "must be a mapping"),
    ("a: : b", "not valid YAML"),
])
def test_bad_yaml_is_a_message(text: str, words: str) -> None:
    with pytest.raises(gr.Error) as excinfo:
        train.apply_yaml(text)
    assert words in error_text(excinfo)


def test_half_typed_values_are_a_notice_not_an_error() -> None:
    extra, values = form(batch_size=2.5)
    out = train.preview(extra, *values)
    assert "whole number" in out["status"] and out["yaml"] is not None
    extra, values = form(learning_rate=None)
    assert "must be a number" in train.preview(extra, *values)["status"]


def test_presets_change_only_their_keys() -> None:
    extra, values = form(seed=123)
    out = train.apply_preset("lora_quality", extra, *values)
    assert out["lora.r"] == 32 and out["learning_rate"] == 1e-4 and out["seed"] == 123
    for name in train.PRESETS:
        assert train.apply_preset(name, extra, *values)["yaml"]


def test_vram_estimate_on_cpu_and_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    extra, values = form()
    assert "No NVIDIA GPU found" in train.preview(extra, *values)["vram"]
    monkeypatch.setattr(train, "_gpu", lambda: ("NVIDIA Test 1GB", 2**30))
    assert "fits" in train.preview(extra, *values)["vram"]
    extra, values = form(batch_size=512, max_seq_length=8192, gradient_checkpointing="off")
    assert "will not fit" in train.preview(extra, *values)["vram"]


def test_vram_estimate_shows_the_host_ram_of_offloaded_layer_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    # the demo model: 4 layers x (128 x 8192 tokens) x 256 hidden x 2 bytes = 2.0 GiB of host RAM
    monkeypatch.setattr(train, "_gpu", lambda: ("NVIDIA Test 80GB", 80 * 2**30))
    monkeypatch.setattr(train, "_host_ram", lambda: 16 * 2**30)
    extra, values = form(batch_size=128, max_seq_length=8192, gradient_checkpointing="offload")
    text = train.preview(extra, *values)["vram"]
    assert "\n\n✅ Offloaded layer inputs: **2.0 GiB** of host RAM (this machine has 16.0 GiB): **fits**." in text
    assert "Lower the max sequence length" not in text
    monkeypatch.setattr(train, "_host_ram", lambda: 2**30)
    text = train.preview(extra, *values)["vram"]
    assert ("⛔ Offloaded layer inputs: **2.0 GiB** of host RAM (this machine has 1.0 GiB): **will not fit**. "
            "Lower the max sequence length or the batch size, or use gradient checkpointing “standard”.") in text
    monkeypatch.setattr(train, "_host_ram", lambda: None)
    assert "**2.0 GiB** of host RAM (this machine's RAM is unknown)" in train.preview(extra, *values)["vram"]
    for mode in ("standard", "off"):
        extra, values = form(batch_size=128, max_seq_length=8192, gradient_checkpointing=mode)
        assert "Offloaded layer inputs" not in train.preview(extra, *values)["vram"]


def test_the_estimate_says_how_much_of_the_model_the_fast_path_covers(tmp_path: Path) -> None:
    """Full, partial (which modules; chat through HF), none (plain HF), and image-text models."""
    import json

    from kestrel.model.registry import SUPPORTED

    assert set(SUPPORTED) <= set(train.S.FAMILY_TITLES)  # every family has a name in the studio
    extra, values = form()
    assert "⚡ **Llama**: on Kestrel's fast path" in train.preview(extra, *values)["vram"]  # the demo model
    qwen35 = {"model_type": "qwen3_5", "vision_config": {"depth": 2},
              "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64, "num_attention_heads": 2,
                              "num_hidden_layers": 4, "vocab_size": 300,
                              "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                              "linear_value_head_dim": 8}}
    for name, config in (("qwen35", qwen35), ("gpt2", {"model_type": "gpt2", "n_embd": 32})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    extra, values = form(model_source="local", model=str(tmp_path / "qwen35"))
    text = train.preview(extra, *values)["vram"]
    assert ("⚡ **Qwen3.5**: partly on Kestrel's fast path (attention, chunked loss, linear attention, MLP, norms); "
            "its other modules run Hugging Face's code, and chat and GRPO rollouts decode through Hugging Face's "
            "forward. An image-text model: its language model trains on text, the vision tower stays frozen.") in text
    assert "GiB" in text  # the estimate itself is there too
    extra, values = form(model_source="local", model=str(tmp_path / "gpt2"))
    text = train.preview(extra, *values)["vram"]
    assert text.startswith("No estimate") and "🐢 No fast path for model type `gpt2` yet" in text


@pytest.mark.parametrize("changes, words", [
    ({"model_source": "local", "model": "/no/such/folder"}, "does not exist"),
    ({"model_source": "hub", "model": "someone/not-cached"}, "offline"),
    ({"model_source": "hub", "model": ""}, "model must name a hub id"),
    ({"dataset": "/no/such/data.jsonl"}, "does not exist any more"),
    ({"method": "qlora"}, "QLoRA needs an NVIDIA GPU"),
    ({"max_seq_length": 8}, "max_seq_length must be 16"),
])
def test_start_refuses_bad_input(changes: dict, words: str) -> None:
    extra, values = form(**changes)
    with pytest.raises(gr.Error) as excinfo:
        train.start_training(extra, *values)
    assert words in error_text(excinfo)
    assert jobs.list_jobs() == []


def test_local_folder_without_config(tmp_path: Path) -> None:
    extra, values = form(model_source="local", model=str(tmp_path))
    with pytest.raises(gr.Error) as excinfo:
        train.start_training(extra, *values)
    assert "has no config.json" in error_text(excinfo)


def test_start_twice_is_refused(fake_engine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "1.0")  # still running when Start is pressed again
    extra, values = form(max_steps=50)
    first = train.start_training(extra, *values)
    assert first["job"] == 1 and "Started job #1" in first["status"]
    with pytest.raises(gr.Error) as excinfo:
        train.start_training(extra, *values)
    assert "already started as job #1" in error_text(excinfo)
    assert len(jobs.list_jobs()) == 1
    extra, values = form(max_steps=51)  # a different run is queued behind it
    second = train.start_training(extra, *values)
    assert second["job"] == 2 and "Queued job #2" in second["status"]


def test_use_dataset_carries_format_and_columns() -> None:
    state = {"path": "/x/qa.csv", "format": "prompt_completion", "columns": {"prompt": "question"}}
    out = train.use_dataset(state, {"grpo": {"rewards": []}})
    assert out["dataset"] == "/x/qa.csv" and out["dataset_format"] == "prompt_completion"
    assert out["extra"] == {"grpo": {"rewards": []}, "columns": {"prompt": "question"}}


def test_picking_another_dataset_drops_the_old_mapping() -> None:
    state = {"path": "/x/qa.csv", "format": "prompt_completion", "columns": {"prompt": "question"}}
    same = train.pick_dataset("/x/qa.csv", state, {})
    assert same == {"dataset_format": "prompt_completion", "extra": {"columns": {"prompt": "question"}}}
    other = train.pick_dataset("/x/chat.jsonl", state, {"columns": {"prompt": "question"}, "grpo": {}})
    assert other == {"dataset_format": "auto", "extra": {"columns": {}, "grpo": {}}}
