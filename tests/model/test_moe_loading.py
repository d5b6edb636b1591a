"""Loading mixture-of-experts checkpoints: gpt-oss's MXFP4 experts dequantized, its attention
in eager (HF has no SDPA path for attention sinks), patched and trainable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kestrel.model.loader import load
from tests.support.mxfp4 import write_mxfp4_gpt_oss
from tests.support.tiny import tiny_model


def test_gpt_oss_mxfp4_checkpoint_loads_dequantized(tmp_path: Path, demo_tokenizer) -> None:
    source = tiny_model("gpt_oss", len(demo_tokenizer), seed=0)
    expected = write_mxfp4_gpt_oss(source, tmp_path)
    demo_tokenizer.save_pretrained(tmp_path)
    model, _ = load(str(tmp_path), 64, dtype="fp32", device="cpu")
    assert model.config._attn_implementation == "eager"
    assert model.kestrel_patch is not None
    params = dict(model.named_parameters())
    for name, value in expected.items():
        assert params[name].dtype == torch.float32
        torch.testing.assert_close(params[name], value, rtol=0, atol=0)  # MXFP4 values are exact in bf16 and fp32
    ids = torch.randint(0, len(demo_tokenizer), (1, 12))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert torch.isfinite(out.loss) and out.aux_loss is not None


def test_gpt_oss_mxfp4_under_4bit_loading_dequantizes_in_place_of_bitsandbytes(tmp_path: Path, demo_tokenizer) -> None:
    """One quantization config per load: MXFP4's dequantization replaces bitsandbytes' (the experts
    then go to NF4 after load; see tests/model/test_moe_nf4.py)."""
    from transformers import BitsAndBytesConfig, Mxfp4Config

    from kestrel.model.loader import _family_kwargs

    write_mxfp4_gpt_oss(tiny_model("gpt_oss", len(demo_tokenizer)), tmp_path)
    kwargs = {"dtype": torch.bfloat16, "attn_implementation": "sdpa", "quantization_config": BitsAndBytesConfig(load_in_4bit=True)}
    _family_kwargs(str(tmp_path), kwargs, load_in_4bit=True)
    assert isinstance(kwargs["quantization_config"], Mxfp4Config) and kwargs["quantization_config"].dequantize
    assert kwargs["attn_implementation"] == "eager"


@pytest.mark.gpu
def test_gpt_oss_mxfp4_loads_in_4bit_with_nf4_experts(tmp_path: Path, demo_tokenizer) -> None:
    from kestrel.model.expert_quant import packed_experts

    source = tiny_model("gpt_oss", len(demo_tokenizer), seed=0)
    write_mxfp4_gpt_oss(source, tmp_path)
    demo_tokenizer.save_pretrained(tmp_path)
    dense, _ = load(str(tmp_path), 64, dtype="bf16")
    model, _ = load(str(tmp_path), 64, load_in_4bit=True)
    assert packed_experts(model.model.layers[0].mlp.experts)
    ids = torch.randint(0, len(demo_tokenizer), (1, 12), device="cuda")
    with torch.no_grad():
        want, got = (m(input_ids=ids, use_cache=False).logits.float() for m in (dense, model))
    assert (got - want).norm() / want.norm() < 0.1
