"""Loading mixture-of-experts checkpoints: gpt-oss's MXFP4 experts dequantized, its attention
in eager (HF has no SDPA path for attention sinks), patched and trainable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kestrel.kernels.moe import PackedExperts
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


def _deinterleave_gate_up(packed: dict[str, PackedExperts]) -> None:
    """Packs gate_up with gpt-oss's interleaved [g0 u0 g1 u1 ...] columns as [gate | up] halves."""
    w = packed["gate_up_proj"].stored().clone()  # (E, H, 2I)
    packed["gate_up_proj"] = PackedExperts(torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1), transposed=True)


def _read_gate_up_transposed(packed: dict[str, PackedExperts]) -> None:
    packed["gate_up_proj"].transposed = False  # (E, H, 2I) read as if stored (E, out, in): square here


def _pack_down_transposed(packed: dict[str, PackedExperts]) -> None:
    """Packs down_proj's (E, I, H) values in (E, H, I) order, under the (E, I, H) shape."""
    w = packed["down_proj"].stored().clone()
    packed["down_proj"] = PackedExperts(w.transpose(1, 2).contiguous().view(w.shape), transposed=True)


def test_gpt_oss_mxfp4_nf4_experts_hold_their_rounded_weights(mxfp4_checkpoint, demo_tokenizer) -> None:
    """The 4-bit path's expert step on the CPU (bitsandbytes' linears need CUDA; gpt-oss under MXFP4 has none)."""
    folder, expected = mxfp4_checkpoint
    model, _ = load(str(folder), 64, dtype="bf16", device="cpu")
    quantize_experts(model, family_of("gpt_oss"))
    ids = torch.randint(0, len(demo_tokenizer), (1, 12), generator=torch.Generator().manual_seed(0))
    assert_nf4_experts_hold(model, expected, ids)


@pytest.mark.parametrize(("wrong", "caught_by"), [
    (_read_gate_up_transposed, "dequantized twin"), (_deinterleave_gate_up, "gate_up_proj: a weight"),
    (_pack_down_transposed, "down_proj: a weight"),
], ids=["read-transposed", "gate-up-deinterleaved", "down-packed-transposed"])
def test_nf4_expert_checks_fail_on_a_wrong_layout(mxfp4_checkpoint, demo_tokenizer, wrong, caught_by: str) -> None:
    folder, expected = mxfp4_checkpoint
    model, _ = load(str(folder), 64, dtype="bf16", device="cpu")
    quantize_experts(model, family_of("gpt_oss"))
    wrong(packed_experts(model.model.layers[1].mlp.experts))
    ids = torch.randint(0, len(demo_tokenizer), (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match=caught_by):
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
