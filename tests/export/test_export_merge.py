"""Merging LoRA adapters into base weights: equal to PEFT's unmerged outputs, streamed safetensors
shards that Hugging Face loads, 4-bit bases dequantized (and said so), the adapter export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from kestrel.config import ALL_LINEAR
from kestrel.errors import KestrelError
from kestrel.export import ExportCheckError, export
from tests.support.export_fixtures import save_tiny_model, train_tokenizer
from kestrel.export.merge import LoraDeltas, ModelTensors, write_safetensors_shards


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer("gpt2", 500)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> Path:
    return save_tiny_model("llama", tokenizer, tmp_path_factory.mktemp("llama"))


def make_run(base: Path, run: Path, method: str = "lora", seed: int = 1, **lora) -> Path:
    """A training output folder (adapter/ + config.yaml) with a random, non-zero LoRA on `base`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ALL_LINEAR, "init_lora_weights": False, **lora})
    peft = get_peft_model(model, config)
    with torch.no_grad():  # PEFT's random init of B is small; make the adapter's effect large
        for name, p in peft.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0, 0.05)
            if "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.05)
    peft.save_pretrained(run / "adapter")
    cfg_path = run / "adapter" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "base_model_name_or_path": str(base)}))
    (run / "config.yaml").write_text(yaml.safe_dump({"model": str(base), "method": method}))
    return run


def _peft_logits(base: Path, run: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), run / "adapter")
    with torch.no_grad():
        tuned = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
    return tuned, plain


def test_merged_tensors_equal_peft_outputs(llama_dir: Path, tmp_path: Path) -> None:
    """rank/alpha patterns, rsLoRA, an embedding LoRA and a fully trained lm_head all merged."""
    run = make_run(llama_dir, tmp_path / "run", target_modules=ALL_LINEAR + ["embed_tokens"], use_rslora=True,
                   rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 3}, modules_to_save=["lm_head"])
    tensors = ModelTensors(llama_dir, run / "adapter")
    assert "model.embed_tokens.weight" in tensors.lora.touched() and "lm_head.weight" in tensors.lora.replaced
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.load_state_dict({n: tensors.get(n) for n in tensors.names()}, strict=True)
    ids = torch.randint(0, 500, (2, 23))
    tuned, plain = _peft_logits(llama_dir, run, ids)
    with torch.no_grad():
        merged = model(ids).logits
    scale = float(tuned.std())
    assert float((tuned - plain).abs().max()) > 0.5 * scale  # the adapter matters, so the test can fail
    torch.testing.assert_close(merged, tuned, rtol=0, atol=1e-5 * scale)


def test_merged_export_bf16_within_tolerance_and_a_wrong_merge_fails(llama_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(llama_dir, tmp_path / "run")
    result = export(run, "merged", tmp_path / "merged", quant="bf16")
    merged = result.checks["merged"]
    assert result.passed and merged["max_error"] <= merged["tolerance"] and merged["top1_agreement"] > 0.95
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert saved.dtype == torch.bfloat16
    assert {p.name for p in (tmp_path / "merged").iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "export.json"}

    original = LoraDeltas.scale
    monkeypatch.setattr(LoraDeltas, "scale", lambda self, module: 2 * original(self, module))
    with pytest.raises(ExportCheckError) as err:
        export(run, "merged", tmp_path / "wrong", quant="bf16")
    assert err.value.result.checks["merged"]["max_error"] > err.value.result.checks["merged"]["tolerance"]
    assert not (tmp_path / "wrong").exists()  # nothing left behind


def test_shards_stream_and_load(llama_dir: Path, tmp_path: Path) -> None:
    run = make_run(llama_dir, tmp_path / "run")
    tensors = ModelTensors(llama_dir, run / "adapter")
    out = tmp_path / "sharded"
    out.mkdir()
    paths = write_safetensors_shards(tensors, out, torch.float32, max_shard_bytes=200_000)
    assert len(paths) > 3 and paths[-1].name == "model.safetensors.index.json"
    AutoModelForCausalLM.from_pretrained(llama_dir).config.save_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, param in loaded.state_dict().items():
        torch.testing.assert_close(param, tensors.get(name), rtol=0, atol=0)


def _quantize_checkpoint(src: Path, dst: Path) -> None:
    """Store the linear weights of `src` as bitsandbytes NF4, the way a `*-bnb-4bit` checkpoint does."""
    import bitsandbytes.functional as bnbf
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    state = {}
    for name, tensor in model.state_dict().items():
        if any(f"{t}.weight" in name for t in ALL_LINEAR):
            packed, quant_state = bnbf.quantize_4bit(tensor, quant_type="nf4", compress_statistics=True)
            state[name] = packed
            state.update({f"{name}.{k}": v for k, v in quant_state.as_dict(packed=True).items()})
        else:
            state[name] = tensor
    dst.mkdir()
    save_file(state, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                     "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            (dst / f.name).write_bytes(f.read_bytes())


def test_qlora_on_a_4bit_base_merges_into_its_dequantization(llama_dir: Path, tmp_path: Path) -> None:
    base4 = tmp_path / "base-bnb-4bit"
    _quantize_checkpoint(llama_dir, base4)
    run = make_run(llama_dir, tmp_path / "run", method="qlora")  # trained on the 16-bit model, pointed at the 4-bit one
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(base4)}))
    tensors = ModelTensors(base4, run / "adapter")
    name = "model.layers.0.mlp.down_proj.weight"
    assert tensors.dequantized and tensors.shape(name) == (128, 256)
    original = AutoModelForCausalLM.from_pretrained(llama_dir).state_dict()[name]
    error = (tensors.checkpoint.get(name).float() - original).abs().max() / original.abs().max()
    assert 1e-3 < float(error) < 0.2  # NF4: close, not equal
    result = export(run, "merged", tmp_path / "merged")
    assert result.passed and any("dequantization" in n for n in result.notes)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged").dtype == torch.bfloat16


def test_qlora_on_a_16bit_base_says_so(llama_dir: Path, tmp_path: Path) -> None:
    run = make_run(llama_dir, tmp_path / "run", method="qlora")
    result = export(run, "merged", tmp_path / "merged", check=False)
    assert any("original 16-bit weights" in n for n in result.notes)


def test_adapter_export_copies_and_loads(llama_dir: Path, tmp_path: Path) -> None:
    run = make_run(llama_dir, tmp_path / "run")
    result = export(run, "adapter", tmp_path / "adapter")
    assert result.passed and result.checks["adapter"]["modules"] == 14
    assert result.checks["adapter"]["max_change_from_base"] > 0
    names = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "export.json"} <= names


def test_adapter_for_another_model_is_refused(llama_dir: Path, tokenizer, tmp_path: Path) -> None:
    other = save_tiny_model("llama", tokenizer, tmp_path / "other", intermediate_size=192)
    run = make_run(llama_dir, tmp_path / "run")
    cfg_path = run / "adapter" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "base_model_name_or_path": str(other)}))
    for fmt in ("adapter", "merged", "gguf"):
        with pytest.raises(KestrelError, match="trained on another model"):
            export(run, fmt, tmp_path / fmt)
        assert not (tmp_path / fmt).exists()
