"""The memory estimate: sizes read from a config, the parts that grow with each setting, and
figures in the range measured for a Llama-3.1-8B-shaped model (bench: Unsloth QLoRA 7.0 GiB,
HF+PEFT 12.8 GiB at batch 2 x 2048 with checkpointing)."""

from __future__ import annotations

import json

import pytest

from engine.estimate import GIB, estimate_training_memory, shape_from_config, verdict
from engine.paths import ASSETS

LLAMA_8B = {"vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "tie_word_embeddings": False}


def test_parameter_count_of_known_models() -> None:
    assert shape_from_config(LLAMA_8B).params == pytest.approx(8.03e9, rel=0.01)
    demo = shape_from_config(json.loads((ASSETS / "demo" / "config.json").read_text()))
    assert demo.params == 3_437_568 - 295_936  # the demo's count printed by training, minus LoRA r=16


def test_llama_8b_figures_are_in_the_measured_range() -> None:
    shape = shape_from_config(LLAMA_8B)
    qlora = estimate_training_memory(shape, "qlora", 16, None, 2, 2048, "standard").total_bytes / GIB
    lora = estimate_training_memory(shape, "lora", 16, None, 2, 2048, "standard").total_bytes / GIB
    full = estimate_training_memory(shape, "full", 16, None, 2, 2048, "standard").total_bytes / GIB
    assert 7.0 <= qlora <= 12.8
    assert 16.0 <= lora <= 24.0  # 15 GiB of bf16 weights plus the rest
    assert 60.0 <= full <= 80.0  # 8 bytes a parameter
    assert estimate_training_memory(shape, "qlora", 16).trainable == 41_943_040  # r=16, all 7 linears


def test_each_setting_moves_the_estimate_the_right_way() -> None:
    shape = shape_from_config(LLAMA_8B)

    def total(**kw: object) -> int:
        base = dict(method="qlora", lora_r=16, batch_size=2, max_seq_length=2048, gradient_checkpointing="standard")
        return estimate_training_memory(shape, **{**base, **kw}).total_bytes  # type: ignore[arg-type]

    assert total(lora_r=64) > total()
    assert total(batch_size=4) > total() and total(max_seq_length=8192) > total()
    assert total(gradient_checkpointing="off") > total() > total(gradient_checkpointing="offload")
    assert total(method="grpo") > total()


def test_verdict_thresholds() -> None:
    assert verdict(7 * GIB, 10 * GIB) == "fits"
    assert verdict(9 * GIB, 10 * GIB) == "tight"
    assert verdict(11 * GIB, 10 * GIB) == "will not fit"


def test_config_without_sizes_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="lacks the sizes"):
        shape_from_config({"model_type": "llama"})


def test_long_context_offload_matches_the_measured_run() -> None:
    # bench/RESULTS.md: 409,600 tokens, QLoRA 8B, batch 1, offload, on an 80 GB H100: 71.85 GiB
    # allocated, 78.29 GiB reserved by the allocator (plus the CUDA context, ~0.6 GiB).
    shape = shape_from_config(LLAMA_8B)
    est = estimate_training_memory(shape, "qlora", 16, None, 1, 409_600, "offload").total_bytes / GIB
    assert 78.9 * 0.95 <= est <= 78.9 * 1.10
    short = estimate_training_memory(shape, "qlora", 16, None, 1, 65_536, "offload").total_bytes / GIB
    assert 16.2 <= short <= 16.2 * 1.25  # session 2 (H200 capped at 80 GiB): 16.17 GiB peak
