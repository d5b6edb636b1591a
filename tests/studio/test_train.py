"""Train tab handlers: the form is the YAML (shown, downloaded, loaded back), presets, memory
estimate, and Start with every kind of bad input answered by a message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import pytest
import yaml

from kestrel import jobs
from kestrel.config import load_config
from kestrel.studio.form import FORM_KEYS
from kestrel.studio.handlers import presets, train
from kestrel.training.estimate import shape_from_config
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
    pandas' NaN for an empty number cell is blank, and a custom reward needs the studio's launch flag."""
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
    assert "--allow-custom-rewards" in error_text(excinfo)


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
    ("model: demo\x16\n", "the YAML box is not valid YAML: character 12 is #x0016, a control character"),  # was "Something went wrong"
])
def test_bad_yaml_is_a_message(text: str, words: str) -> None:
    with pytest.raises(gr.Error) as excinfo:
        train.apply_yaml(text)
    assert words in error_text(excinfo)


@pytest.mark.parametrize("changes, words", [
    ({"max_steps": 1e12}, "max_steps must be at most 10,000,000"),
    ({"epochs": 1e9}, "epochs must be at most 1,000"),
    ({"max_seq_length": 10**9}, "max_seq_length must be 16..1048576"),
    ({"learning_rate": 50.0}, "learning_rate must be in (0, 1)"),
    ({"batch_size": 10**6}, "batch_size must be 1..4096"),
])
def test_absurd_values_name_their_field_in_the_form(changes: dict, words: str) -> None:
    extra, values = form(**changes)
    assert words in train.preview(extra, *values)["status"]
    with pytest.raises(gr.Error) as excinfo:
        train.start_training(extra, *values)
    assert words in error_text(excinfo) and jobs.list_jobs() == []


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
    for name in presets.PRESETS:
        assert train.apply_preset(name, extra, *values)["yaml"]


def _again(out: dict) -> list:
    """The filled form as apply_preset's arguments after the preset's name."""
    return [out["extra"], *[out[k] for k in FORM_KEYS]]


def test_a_preset_sets_every_field_it_owns_keeps_the_users_dataset_and_says_what_changed(kestrel_home: Path) -> None:
    mine = str(kestrel_home / "datasets" / "mine.jsonl")
    extra, values = form(dataset=mine, model_source="hub", model="someone/model")
    qlora = train.apply_preset("qlora_8b", extra, *values)
    assert qlora["grad_accum"] == 4 and qlora["dataset"] == mine and qlora["model"] == "someone/model"
    assert "Gradient accumulation: 1 → 4" in qlora["status"] and "Kept your model and dataset" in qlora["status"]
    # The quick test has no gradient accumulation of its own: it sets the default, not the last preset's.
    quick = train.apply_preset("demo", *_again(qlora))
    assert quick["grad_accum"] == 1 and quick["gradient_checkpointing"] == "off" and quick["max_steps"] == 300
    assert quick["dataset"] == mine and quick["model_source"] == "demo"  # it needs the demo model
    assert "Gradient accumulation: 4 → 1" in quick["status"] and "Folder or hub id: someone/model → demo" in quick["status"]
    assert "Kept your dataset" in quick["status"]
    # Every preset over every other sets what it owns as it does alone: nothing leaks from the one before.
    owned = [k for k in FORM_KEYS if k in presets.owned()]
    assert {"grad_accum", "method", "max_steps", "epochs", "gradient_checkpointing"} <= set(owned)
    for first in presets.PRESETS:
        for second in presets.PRESETS:
            out = train.apply_preset(second, *_again(train.apply_preset(first, extra, *values)))
            alone = train.apply_preset(second, extra, *values)
            assert {k: out[k] for k in owned} == {k: alone[k] for k in owned}, (first, second)


def test_a_preset_fills_an_empty_dataset() -> None:
    extra, values = form(dataset="")
    assert train.apply_preset("demo", extra, *values)["dataset"] == "arithmetic_chat"


def test_vram_estimate_on_cpu_and_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    extra, values = form()
    assert "No NVIDIA GPU found" in train.preview(extra, *values)["vram"]
    monkeypatch.setattr(train, "_gpu", lambda: ("NVIDIA Test 1GB", 2**30))
    assert "fits" in train.preview(extra, *values)["vram"]
    extra, values = form(batch_size=512, max_seq_length=8192, gradient_checkpointing="off")
    assert "will not fit" in train.preview(extra, *values)["vram"]


LLAMA_8B = {"vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "tie_word_embeddings": False}


def test_without_a_gpu_the_estimate_is_for_a_picked_card(kestrel_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without a GPU the user picks a common card; the estimate is for the model
    in the form on that card, so QLoRA at 2,048 tokens costs more than at 512 (and more than
    the 1 GiB a tiny model would)."""
    import json

    monkeypatch.setattr(train, "_gpu", lambda: None)
    assert train.gpu_picker()["gpu"]["visible"] is True
    tmp_path = kestrel_home / "models" / "llama-8b"  # the studio reads local models inside KESTREL_HOME only
    tmp_path.mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    card = "NVIDIA GeForce RTX 4090 (24 GB)"
    texts = {}
    for length in (512, 2048, 16384):
        extra, values = form(model_source="local", model=str(tmp_path), method="qlora", batch_size=2,
                             max_seq_length=length, gradient_checkpointing="standard")
        assert "No NVIDIA GPU found" in train.preview(extra, *values)["vram"]
        texts[length] = train.preview(extra, *values, gpu=card)["vram"]
        assert card in texts[length] and "(24.0 GiB)" in texts[length], texts[length]
    peaks = {n: float(__import__("re").search(r"about \*\*([\d.]+) GiB", t).group(1)) for n, t in texts.items()}
    assert 5 < peaks[512] < peaks[2048] < peaks[16384], peaks
    assert "fits" in texts[512]
    monkeypatch.setattr(train, "_gpu", lambda: ("NVIDIA Test 8GB", 8 * 2**30))
    assert train.gpu_picker()["gpu"]["visible"] is False
    assert "NVIDIA Test 8GB" in train.preview(extra, *values, gpu=card)["vram"]  # a real GPU wins


def test_the_estimate_on_several_gpus_is_per_gpu(kestrel_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`devices: 4` on an 80 GB card: a full fine-tune of the 8B shape is sharded, so each GPU
    holds about a third of what one would, and the line says it is per GPU, on 4 GPUs; on the CPU
    the RAM is every rank's process together."""
    import json
    import re

    model = kestrel_home / "models" / "llama-8b"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(LLAMA_8B))

    def text(devices: str) -> str:
        extra, values = form(model_source="local", model=str(model), method="full", batch_size=2,
                             max_seq_length=2048, gradient_checkpointing="standard", devices=devices)
        return train.preview(extra, *values)["vram"]

    def peak(vram: str) -> float:
        return float(re.search(r"about \*\*([\d.]+) GiB", vram).group(1))

    cpu_one, cpu_four = text("1"), text("4")
    monkeypatch.setattr(train, "_gpu", lambda: ("NVIDIA Test 80GB", 80 * 2**30))
    one, four = text("1"), text("4")
    assert "per GPU" not in one and "peak per GPU, on 4 GPUs" in four, four
    assert "fits" not in one.split("**")[1] and "**fits**" in four
    assert 0.25 < peak(four) / peak(one) < 0.45
    ram = [float(re.search(r"about ([\d.]+) GiB of RAM", t).group(1)) for t in (cpu_one, cpu_four)]
    assert ram[1] == pytest.approx(4 * peak(four), rel=0.01) and ram[0] == pytest.approx(peak(one), rel=0.01)


def test_vram_estimate_shows_the_host_ram_of_offloaded_layer_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    # the demo model: 4 layers x (128 x 8192 tokens) x 256 hidden x 2 bytes = 2.0 GiB of host RAM
    monkeypatch.setattr(train, "_gpu", lambda: ("NVIDIA Test 80GB", 80 * 2**30))
    monkeypatch.setattr(train, "_host_ram", lambda: 16 * 2**30)
    extra, values = form(batch_size=128, max_seq_length=8192, gradient_checkpointing="offload")
    text = train.preview(extra, *values)["vram"]
    assert ("\n\n✅ Offloaded activations (layer inputs, MLP gate products): **2.0 GiB** of host RAM "
            "(this machine has 16.0 GiB): **fits**.") in text
    assert "Lower the max sequence length" not in text
    monkeypatch.setattr(train, "_host_ram", lambda: 2**30)
    text = train.preview(extra, *values)["vram"]
    assert ("⛔ Offloaded activations (layer inputs, MLP gate products): **2.0 GiB** of host RAM "
            "(this machine has 1.0 GiB): **will not fit**. "
            "Lower the max sequence length or the batch size, or use gradient checkpointing “standard”.") in text
    monkeypatch.setattr(train, "_host_ram", lambda: None)
    assert "**2.0 GiB** of host RAM (this machine's RAM is unknown)" in train.preview(extra, *values)["vram"]
    for mode in ("standard", "off"):
        extra, values = form(batch_size=128, max_seq_length=8192, gradient_checkpointing=mode)
        assert "Offloaded activations" not in train.preview(extra, *values)["vram"]


def test_estimate_takes_the_runs_offload_gate() -> None:
    """The studio's offload host RAM (and so `auto`'s choice) counts the gate products a run pages out:
    `performance.offload_gate` from the YAML, as the run reads it (short rows: the MLP keeps E)."""
    extra, values = form(batch_size=2, max_seq_length=256, gradient_checkpointing="offload")
    data = train.form_to_config(dict(zip(FORM_KEYS, values)), extra)
    shape = shape_from_config(train.model_config(data["model"]))
    every = train._estimate(shape, data, 1, "offload").offload_host_ram
    data["performance"] = {"offload_gate": 0.0}
    inputs_only = train._estimate(shape, data, 1, "offload").offload_host_ram
    assert inputs_only == shape.layers * 2 * 256 * shape.hidden * 2
    assert every == inputs_only + shape.layers * 2 * 256 * shape.intermediate * 2


def test_auto_checkpointing_says_what_a_run_here_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` (the default) on one GPU with room in RAM: offload, its host RAM shown; with too little
    RAM, or on several GPUs, or on the CPU: standard, with the reason; the estimate follows the choice."""
    import re

    monkeypatch.setattr(train, "_gpu", lambda: ("NVIDIA Test 80GB", 80 * 2**30))
    monkeypatch.setattr(train, "_host_ram", lambda: 16 * 2**30)
    extra, values = form(batch_size=128, max_seq_length=8192, gradient_checkpointing="auto")
    peak = lambda text: float(re.search(r"about \*\*([\d.]+) GiB", text).group(1))  # noqa: E731
    offload = train.preview(extra, *values)["vram"]
    assert "Gradient checkpointing **auto** → **offload** here: one GPU" in offload
    assert "Offloaded activations (layer inputs, MLP gate products): **2.0 GiB**" in offload
    extra_off, values_off = form(batch_size=128, max_seq_length=8192, gradient_checkpointing="offload")
    assert peak(offload) == peak(train.preview(extra_off, *values_off)["vram"])
    monkeypatch.setattr(train, "_host_ram", lambda: 2**30)
    standard = train.preview(extra, *values)["vram"]
    assert "**auto** → **standard** here: one GPU, but offloading would pin 2.0 GiB" in standard
    assert "Offloaded activations" not in standard and peak(standard) > peak(offload)
    monkeypatch.setattr(train, "_gpu", lambda: None)
    assert "**auto** → **standard** here: no CUDA device" in train.preview(extra, *values)["vram"]


def test_the_estimate_says_how_much_of_the_model_the_fast_path_covers(kestrel_home: Path) -> None:
    """Full, partial (which modules; chat through HF), none (plain HF), and image-text models."""
    import json

    tmp_path = kestrel_home / "models"  # the studio reads local models inside KESTREL_HOME only

    from kestrel.model.registry import SUPPORTED

    assert set(SUPPORTED) <= set(train.S.FAMILY_TITLES)  # every family has a name in the studio
    extra, values = form()
    assert "**Llama**: on Kestrel's fast path" in train.preview(extra, *values)["vram"]  # the demo model
    qwen35 = {"model_type": "qwen3_5", "vision_config": {"depth": 2},
              "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64, "num_attention_heads": 2,
                              "num_hidden_layers": 4, "vocab_size": 300,
                              "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                              "linear_value_head_dim": 8}}
    for name, config in (("qwen35", qwen35), ("gpt2", {"model_type": "gpt2", "n_embd": 32})):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    extra, values = form(model_source="local", model=str(tmp_path / "qwen35"))
    text = train.preview(extra, *values)["vram"]
    assert ("**Qwen3.5**: trains on Kestrel's fast path (its kernels, padding-free packing); chat and GRPO rollouts "
            "decode through Hugging Face's forward. An image-text model: its language model trains on text, the "
            "vision tower stays frozen.") in text
    assert "GiB" in text  # the estimate itself is there too
    extra, values = form(model_source="local", model=str(tmp_path / "gpt2"))
    text = train.preview(extra, *values)["vram"]
    assert text.startswith("No estimate") and "No fast path for model type `gpt2` yet" in text


def test_the_fast_path_line_names_qwen3_5_moe() -> None:
    """A Qwen3.5-MoE checkpoint (image-text, as Qwen ships it): named, with what runs on the fast path."""
    config = {"model_type": "qwen3_5_moe", "vision_config": {"depth": 2}, "text_config": {"model_type": "qwen3_5_moe_text"}}
    assert train.fast_path_text(config).startswith(
        "**Qwen3.5-MoE**: trains on Kestrel's fast path (its kernels, padding-free packing); chat and GRPO rollouts "
        "decode through Hugging Face's forward.")


@pytest.mark.parametrize("changes, words", [
    ({"model_source": "local", "model": "./no-such-folder"}, "does not exist"),
    ({"model_source": "local", "model": "/no/such/folder"}, "is outside the studio's folder"),
    ({"model_source": "hub", "model": "someone/not-cached"}, "offline"),
    ({"model_source": "hub", "model": ""}, "model must name a hub id"),
    ({"dataset": "gone.jsonl"}, "does not exist any more"),
    ({"dataset": "/no/such/data.jsonl"}, "is outside the studio's folder"),
    ({"method": "qlora"}, "QLoRA needs an NVIDIA GPU"),
    ({"max_seq_length": 8}, "max_seq_length must be 16"),
    ({"eval_dataset": "/etc/hostname"}, "eval_dataset '/etc/hostname' is outside the studio's folder"),
    ({"eval_dataset": "held.jsonl"}, "eval_dataset held.jsonl does not exist: upload the file"),
    ({"eval_split": 0.1, "eval_dataset": "arithmetic_chat"}, "eval_dataset and eval_split both name"),
    ({"eval_split": 0.9}, "eval_split must be a fraction from 0 to 0.5"),
    ({"early_stopping__patience": 2}, "early_stopping needs an evaluation set"),
    ({"eval_steps": 0, "eval_split": 0.1}, "eval_steps must be at least 1"),
])
def test_start_refuses_bad_input(changes: dict, words: str) -> None:
    extra, values = form(**changes)
    with pytest.raises(gr.Error) as excinfo:
        train.start_training(extra, *values)
    assert words in error_text(excinfo)
    assert jobs.list_jobs() == []


def test_evaluation_is_set_in_the_form_and_round_trips() -> None:
    """The Evaluation section: a held-out share, the interval, early stopping and the reporters become
    the config's fields (TRL's names), and the YAML fills the same widgets back."""
    extra, values = form(eval_split=0.1, eval_steps=20, early_stopping__patience=3,
                         early_stopping__min_delta=0.01, report_to=["tensorboard"])
    out = train.preview(extra, *values)
    assert out["status"] == "", out["status"]
    data = yaml.safe_load(out["yaml"])
    assert (data["eval_split"], data["eval_steps"], data["report_to"]) == (0.1, 20, ["tensorboard"])
    assert data["early_stopping"] == {"patience": 3, "min_delta": 0.01} and data.get("eval_dataset") is None
    back = train.apply_yaml(out["yaml"])
    assert [back[k] for k in FORM_KEYS] == values and "early_stopping" not in back["extra"]
    emptied = train.apply_yaml("eval_split: 0.05\neval_steps: null\n")
    assert emptied["eval_split"] == 0.05 and emptied["eval_steps"] in (None, "")  # empty: the automatic interval


def test_start_submits_the_evaluation_file_as_the_checked_path(fake_engine: None, kestrel_home: Path) -> None:
    """An evaluation file named as the dataset is (a name from datasets/, or a sample) reaches the
    worker as the absolute path that was checked."""
    (kestrel_home / "datasets").mkdir(parents=True, exist_ok=True)
    held = kestrel_home / "datasets" / "held.jsonl"
    held.write_text('{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}\n')
    extra, values = form(eval_dataset="held.jsonl", max_steps=3)
    out = train.start_training(extra, *values)
    assert out["job"] == 1
    assert jobs.get_job(1).config["eval_dataset"] == str(held.resolve())


def test_local_folder_without_config(kestrel_home: Path) -> None:
    (kestrel_home / "models" / "empty").mkdir(parents=True)
    extra, values = form(model_source="local", model=str(kestrel_home / "models" / "empty"))
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


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_a_model_folder_with_a_broken_config_is_a_notice_in_the_estimate(kestrel_home: Path, content: bytes) -> None:
    """Old: the live preview raised JSONDecodeError (an error box) on every edit of the form."""
    folder = kestrel_home / "models" / "broken"
    folder.mkdir(parents=True)
    (folder / "config.json").write_bytes(content)
    extra, values = form(model_source="local", model=str(folder))
    assert "config.json cannot be read" in train.preview(extra, *values)["vram"]


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An online machine whose hub is a local server: `someone/real` exists, every other id is
    unknown (404 RepoNotFound), `someone/gated` is gated (401 GatedRepo)."""
    import http.server
    import json
    import threading

    from huggingface_hub import constants

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            known = self.path.startswith("/api/models/someone/real")
            gated = self.path.startswith("/api/models/someone/gated")
            self.send_response(200 if known else 401 if gated else 404)
            self.send_header("Content-Type", "application/json")
            if not known:
                self.send_header("X-Error-Code", "GatedRepo" if gated else "RepoNotFound")
            self.end_headers()
            self.wfile.write(json.dumps({"id": "someone/real"} if known else {"error": "no"}).encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read once, when huggingface_hub was imported
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield constants.ENDPOINT
    server.shutdown()


def test_start_looks_an_unknown_hub_id_up_before_queueing(fake_hub: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import time

    from huggingface_hub import constants

    from kestrel.studio.handlers.common import check_model

    check_model("someone/real", look_up=True)  # exists on the hub: accepted, the job downloads it
    for model, words in (("someone/no-such-model", "neither in the local Hugging Face cache nor on the hub"),
                         ("someone/gated", "is gated")):
        extra, values = form(model_source="hub", model=model)
        with pytest.raises(gr.Error) as excinfo:
            train.start_training(extra, *values)
        assert words in error_text(excinfo)
    # No network: a port nobody listens on stands for an unreachable hub; the answer comes at once.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed}")
    extra, values = form(model_source="hub", model="someone/real")
    began = time.monotonic()
    with pytest.raises(gr.Error) as excinfo:
        train.start_training(extra, *values)
    assert time.monotonic() - began < 10
    assert "not in the local Hugging Face cache, and the hub could not be reached" in error_text(excinfo)
    assert "offline" in error_text(excinfo) and jobs.list_jobs() == []


def test_the_devices_box_reads_counts_auto_and_gpu_ids() -> None:
    assert [train.devices_from_text(v) for v in ("", "2", "auto", "0, 1", " 3 ")] == [1, 2, "auto", [0, 1], 3]
    extra, values = form(devices="0, 2")
    assert "devices:\n- 0\n- 2" in train.preview(extra, *values)["yaml"]
    extra, values = form(devices="two")
    assert "devices must be auto" in train.preview(extra, *values)["status"]
    assert train.config_to_form({"devices": [0, 1]})["devices"] == "0, 1"
