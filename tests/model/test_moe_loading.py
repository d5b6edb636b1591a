"""Loading mixture-of-experts checkpoints: gpt-oss's MXFP4 experts dequantized, its attention
in eager (HF has no SDPA path for attention sinks), patched and trainable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kestrel.model.expert_quant import packed_experts, quantize_experts
from kestrel.model.loader import load
from kestrel.model.registry import family_of
from tests.support.mxfp4 import write_mxfp4_gpt_oss
from tests.support.nf4_experts import assert_nf4_experts_hold
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


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny gpt-oss with MXFP4 experts, and its expert weights as HF lays them out."""
    folder = tmp_path_factory.mktemp("mxfp4")
    expected = write_mxfp4_gpt_oss(tiny_model("gpt_oss", len(demo_tokenizer), seed=0), folder)
    demo_tokenizer.save_pretrained(folder)
    return folder, expected


def test_gpt_oss_mxfp4_nf4_experts_hold_their_rounded_weights(mxfp4_checkpoint, demo_tokenizer) -> None:
    """The 4-bit path's expert step on the CPU (bitsandbytes' linears need CUDA; gpt-oss under MXFP4 has none).
    That the check fails on a wrong layout: tests/model/test_moe_nf4.py."""
    folder, expected = mxfp4_checkpoint
    model, _ = load(str(folder), 64, dtype="bf16", device="cpu")
    quantize_experts(model, family_of("gpt_oss"))
    ids = torch.randint(0, len(demo_tokenizer), (1, 12), generator=torch.Generator().manual_seed(0))
    assert_nf4_experts_hold(model, expected, ids)


@pytest.mark.gpu
def test_gpt_oss_mxfp4_loads_in_4bit_with_nf4_experts(mxfp4_checkpoint, demo_tokenizer) -> None:
    """Not the 16-bit model's logits: NF4's 9% weight error moves this tiny model's logits about 32%
    (its gain, see tests/support/nf4_experts.py); the NF4 experts hold and compute with their rounded weights."""
    folder, expected = mxfp4_checkpoint
    model, _ = load(str(folder), 64, load_in_4bit=True)
    assert set(packed_experts(model.model.layers[0].mlp.experts)) == {"gate_up_proj", "down_proj"}
    ids = torch.randint(0, len(demo_tokenizer), (1, 12), device="cuda")
    assert_nf4_experts_hold(model, expected, ids)
