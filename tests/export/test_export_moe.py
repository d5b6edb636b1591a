"""Export of mixture-of-experts models: PEFT's per-expert LoRA merged (merged 16-bit checked
against PEFT, GGUF checked with llama.cpp), and gpt-oss's MXFP4 checkpoint dequantized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from kestrel.export import ExportCheckError, export
from kestrel.export.experts import ExpertTensors
from tests.support.export_fixtures import FAMILY_STYLE, decisive, save_tiny_model, train_tokenizer
from tests.support.mxfp4 import write_mxfp4_gpt_oss
from tests.support.tiny import tiny_model

MOE = ("qwen3_moe", "gpt_oss", "qwen3_5_moe_text")  # merged and GGUF


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {style: train_tokenizer(style, 600) for style in {FAMILY_STYLE[f] for f in MOE}}


def _run(base: Path, run: Path, seed: int = 1) -> Path:
    """A LoRA run folder on `base` with non-zero factors on attention and on every expert."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    peft = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft.save_pretrained(run / "adapter")
    path = run / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "base_model_name_or_path": str(base)}))
    (run / "config.yaml").write_text(yaml.safe_dump({"model": str(base), "method": "lora"}))
    return run


@pytest.mark.parametrize("family", MOE)
def test_expert_lora_merges_as_peft_computes_and_a_wrong_merge_fails(
    family: str, tokenizers: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = save_tiny_model(family, tokenizers[FAMILY_STYLE[family]], tmp_path / "base")
    run = _run(base, tmp_path / "run")
    result = export(run, "merged", tmp_path / "merged", quant="f32")
    merged = result.checks["merged"]
    assert result.passed and merged["max_error"] <= merged["tolerance"], merged
    original = ExpertTensors._delta
    monkeypatch.setattr(ExpertTensors, "_delta", lambda self, key, dev: None if original(self, key, dev) is None
                        else 2 * original(self, key, dev))
    with pytest.raises(ExportCheckError):
        export(run, "merged", tmp_path / "wrong", quant="f32")


@pytest.mark.parametrize("family", MOE)
def test_gguf_of_an_expert_lora_run_gives_peft_greedy_tokens(family: str, tokenizers: dict, tmp_path: Path) -> None:
    base = save_tiny_model(family, tokenizers[FAMILY_STYLE[family]], tmp_path / "base")
    result = export(_run(base, tmp_path / "run"), "gguf", tmp_path / "out", quant="f16")
    f16 = result.checks["gguf_f16"]
    assert result.passed and f16.passed and f16.ties <= 1 and (f16.greedy_identical or f16.ties == 1), f16


def test_gguf_of_gpt_oss_mxfp4_checkpoint(tokenizers: dict, tmp_path: Path) -> None:
    tokenizer = tokenizers[FAMILY_STYLE["gpt_oss"]]
    model = decisive(tiny_model("gpt_oss", len(tokenizer)))
    for key in ("bos", "eos", "pad"):
        setattr(model.config, f"{key}_token_id", getattr(tokenizer, f"{key}_token_id"))
    write_mxfp4_gpt_oss(model, tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    result = export(tmp_path / "base", "gguf", tmp_path / "out", quant="q8_0")
    assert result.passed, result.summary()
    assert result.checks["gguf_q8_0"].top1_agreement >= 0.9
