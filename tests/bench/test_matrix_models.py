"""bench/matrix.py's mixture-of-experts cells on the CPU: folders without the routed experts'
weights load in Kestrel and in the HF baseline, a short disk fails before the build, the HF
baseline asks for eager attention where HF has no SDPA path, and the table says how experts were held."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench.matrix import expert_storage
from bench.matrix_models import expert_weight_names, write_model_dir
from bench.matrix_table import render_table
from bench.train import hf_load_kwargs
from kestrel.model.loader import load
from tests.support.tiny import tiny_config, tiny_model

MOE = ["qwen3_moe", "gpt_oss", "qwen3_5_moe_text"]


def _saved_keys(folder: Path) -> set[str]:
    keys: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    return keys


@pytest.mark.parametrize("family", MOE)
def test_moe_folder_leaves_the_experts_out_and_kestrel_loads_them_initialised(family, tmp_path, demo_tokenizer) -> None:
    cfg = tiny_config(family, len(demo_tokenizer))
    folder = write_model_dir(cfg, tmp_path / family, "cpu", family)
    model, _ = load(str(folder), 64, dtype="fp32", device="cpu")
    experts = expert_weight_names(model)
    assert experts and not any(".experts." in k for k in _saved_keys(folder))  # in either key layout HF saves
    assert {n for n, _ in model.named_parameters()} - experts <= _saved_keys(folder) | {"lm_head.weight"}
    params = dict(model.named_parameters())
    for name in experts:
        p = params[name]
        assert p.device.type == "cpu" and torch.isfinite(p).all()
        assert name.endswith("_bias") or 0.01 < float(p.detach().std()) < 0.04  # initialised as from_config does (std 0.02)


def test_a_dense_folder_keeps_every_weight(tmp_path, demo_tokenizer) -> None:
    folder = write_model_dir(tiny_config("qwen3", len(demo_tokenizer)), tmp_path / "dense", "cpu", "dense")
    model = tiny_model("qwen3", len(demo_tokenizer))
    assert not expert_weight_names(model)
    assert {n for n, _ in model.named_parameters()} <= _saved_keys(folder) | {"lm_head.weight"}


def test_building_refuses_before_anything_is_built_when_the_disk_is_short(tmp_path, demo_tokenizer, monkeypatch) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("bench.matrix_models.shutil.disk_usage", lambda _: usage(10**12, 10**12 - 10**6, 10**6))
    with pytest.raises(OSError, match=r"building big needs about .* GB free at .* remove other models' folders"):
        write_model_dir(tiny_config("qwen3_moe", len(demo_tokenizer)), tmp_path / "m" / "big", "cpu", "big")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("family, attention", [("gpt_oss", "eager"), ("qwen3_moe", "sdpa")])
def test_hf_baseline_asks_for_eager_attention_for_attention_sinks_only(family, attention, tmp_path, demo_tokenizer) -> None:
    folder = write_model_dir(tiny_config(family, len(demo_tokenizer)), tmp_path / family, "cpu", family)
    for method in ("lora", "qlora"):
        assert hf_load_kwargs(folder, method)["attn_implementation"] == attention


def test_expert_storage_tells_nf4_from_16_bit_and_says_nothing_for_a_dense_model(demo_tokenizer) -> None:
    from kestrel.model.expert_quant import quantize_experts
    from kestrel.model.patching import patch_model
    from kestrel.model.registry import family_of

    model = tiny_model("qwen3_moe", len(demo_tokenizer), dtype=torch.bfloat16)
    assert expert_storage(model) == {"expert_storage": ["bfloat16"]}
    patch_model(model)
    quantize_experts(model, family_of("qwen3_moe"))
    assert expert_storage(model) == {"expert_storage": ["nf4"]}
    assert expert_storage(tiny_model("qwen3", len(demo_tokenizer))) == {}


def test_table_notes_how_each_system_held_the_experts_under_qlora() -> None:
    base = dict(model="qwen3-30b-a3b", method="qlora", layout="packed", tokens_per_s=1.0, peak_alloc_gib=1.0,
                peak_reserved_gib=1.0)
    table = render_table([dict(base, system="kestrel", expert_storage=["nf4"]),
                          dict(base, system="hf", expert_storage=["bfloat16"])], ["packed"])
    assert "keeps them 16-bit" in table
    assert "- qwen3-30b-a3b qlora packed: experts held as kestrel nf4; hf bfloat16" in table
    dense = render_table([dict(base, model="qwen3-4b", system="kestrel")], ["packed"])
    assert "experts" not in dense


def test_results_mirror_into_another_folder_and_are_not_copied_onto_themselves(tmp_path: Path) -> None:
    from bench.matrix_runner import append_record

    out, mirror = tmp_path / "res" / "m.jsonl", tmp_path / "mirror"
    append_record(out, {"a": 1}, str(mirror))
    append_record(out, {"a": 2}, str(mirror))
    assert (mirror / "m.jsonl").read_text() == out.read_text() and len(out.read_text().splitlines()) == 2
    append_record(out, {"a": 3}, str(out.parent))  # --mirror naming the results' own folder
    assert len(out.read_text().splitlines()) == 3


def test_table_sets_kestrels_default_checkpointing_against_standard() -> None:
    base = dict(model="qwen3-4b", method="qlora", layout="packed", peak_alloc_gib=1.0, peak_reserved_gib=1.0)
    table = render_table([dict(base, system="kestrel", tokens_per_s=12.0, checkpointing="offload"),
                          dict(base, system="kestrel-std", tokens_per_s=10.0)], ["packed"])
    assert "| auto / standard ckpt |" in table and "| 1.20x (offload) |" in table
    alone = render_table([dict(base, system="kestrel", tokens_per_s=12.0, checkpointing="offload")], ["packed"])
    assert "(offload)" not in alone


def test_table_compares_systems_only_within_one_chunk() -> None:
    """A ratio is of records run side by side: a later Kestrel run without a baseline beside it leaves the cell on
    the latest chunk that has both; a forced mode from another chunk is not compared with auto."""
    base = dict(model="qwen3-4b", method="qlora", layout="padded", peak_alloc_gib=1.0, peak_reserved_gib=1.0)
    records = [dict(base, system="kestrel", tokens_per_s=20.0), dict(base, system="kestrel-on", tokens_per_s=40.0),
               dict(base, system="unsloth", tokens_per_s=10.0),  # legacy records: no chunk, one chunk of their own
               dict(base, system="kestrel", tokens_per_s=30.0, chunk="b"), dict(base, system="unsloth", tokens_per_s=20.0, chunk="b"),
               dict(base, system="kestrel", tokens_per_s=99.0, chunk="c")]  # alone in its chunk
    row = render_table(records, ["padded"]).splitlines()[2]
    assert "| 30 | 20 |  | 1.50x |  |" in row, row
    assert "| 20 | 10 |  | 2.00x | 0.50x (vs on) |" in render_table(records[:3], ["padded"]).splitlines()[2]
    assert "| 99 |  |" in render_table(records[-1:], ["padded"]).splitlines()[2]  # nothing paired: the latest chunk


def test_table_says_where_the_dense_matrix_misses_its_targets_and_what_is_not_measured() -> None:
    base = dict(layout="packed", peak_alloc_gib=1.0, peak_reserved_gib=1.0)
    records = [
        dict(base, model="qwen3-4b", method="qlora", system="kestrel", tokens_per_s=11.0),
        dict(base, model="qwen3-4b", method="qlora", system="unsloth", tokens_per_s=10.0),  # 1.10x: under
        dict(base, model="qwen3-8b", method="qlora", system="kestrel", tokens_per_s=13.0, peak_reserved_gib=1.5),
        dict(base, model="qwen3-8b", method="qlora", system="unsloth", tokens_per_s=10.0),  # 1.30x, 0.5 GiB over
        dict(base, model="mistral-7b", method="qlora", system="kestrel", tokens_per_s=13.0),
        dict(base, model="mistral-7b", method="qlora", system="unsloth", error="CUDA out of memory"),
        dict(base, model="qwen3-30b-a3b", method="qlora", system="kestrel", tokens_per_s=1.0),  # experts: not listed
    ]
    table = render_table(records, ["packed"])
    assert "- Under 1.2x Unsloth: qwen3-4b qlora packed (1.10x)\n" in table
    assert "- Reserved peak over Unsloth's: qwen3-8b qlora packed (+0.50 GiB)\n" in table
    assert "- No Unsloth run beside Kestrel's: mistral-7b qlora packed (Unsloth: OOM)\n" in table
    missing = table.split("- Not measured: ")[1]
    assert "qwen3-4b (lora packed)" in missing and "llama-3.2-1b (qlora packed, lora packed)" in missing
    assert "qwen3-30b-a3b" not in missing and "qwen3-4b (qlora" not in missing
