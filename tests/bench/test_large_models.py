"""bench/large_models.py on the CPU: a checkpoint of B decoder layers written again at the real
depth loads in transformers, layer i equal to layer i % B, everything outside the layers as saved."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench import large_models
from bench.large_models import INDEX, replicated_names, write_replicated
from tests.support.tiny import tiny_model


def test_replicated_names_map_each_layer_to_its_source() -> None:
    keys = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight",
            "model.layers.1.mlp.up_proj.weight.absmax", "lm_head.weight"]
    names = replicated_names(keys, built=2, total=5)
    assert names["model.layers.4.mlp.up_proj.weight"] == "model.layers.0.mlp.up_proj.weight"
    assert names["model.layers.3.mlp.up_proj.weight.absmax"] == "model.layers.1.mlp.up_proj.weight.absmax"
    assert names["lm_head.weight"] == "lm_head.weight" and len(names) == 2 + 5 + 2
    with pytest.raises(ValueError, match=r"layers are \[0, 1\], expected 0..2"):
        replicated_names(keys, built=3, total=6)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_two_layer_checkpoint_loads_at_five_layers(family, tmp_path, demo_tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(large_models, "SHARD_BYTES", 64 * 1024)  # several shards even at a tiny size
    source = tiny_model(family, len(demo_tokenizer))
    assert source.config.num_hidden_layers == 2
    source.save_pretrained(tmp_path / "src")
    demo_tokenizer.save_pretrained(tmp_path / "src")
    write_replicated(tmp_path / "src", tmp_path / "big", total=5)
    index = json.loads((tmp_path / "big" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    big = AutoModelForCausalLM.from_pretrained(tmp_path / "big")
    assert big.config.num_hidden_layers == 5 and (tmp_path / "big" / "tokenizer_config.json").exists()
    want = dict(source.named_parameters())
    for name, param in big.named_parameters():
        parts = name.split(".")
        if "layers" in parts:
            at = parts.index("layers") + 1
            parts[at] = str(int(parts[at]) % 2)
        torch.testing.assert_close(param, want[".".join(parts)], rtol=0, atol=0, msg=name)
