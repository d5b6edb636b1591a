"""An image-text model's text calls on Kestrel's head (`forwards.make_image_text_forward`): the chunked
loss instead of HF's (B, T, V) logits, with HF's loss, logits and LoRA gradients; calls that carry images
go to HF's own forward."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kestrel import kernels
from kestrel.model.multimodal import lora_targets, media_inputs
from kestrel.model.patching import patch_lora_layers, patch_model, unpatch_model
from tests.support.compare import assert_same_trainable_grads
from tests.support.tiny_image_text import IMAGE_TEXT, tiny_image_text_model

VOCAB = 300


def _pair(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(HF's model with LoRA, the same patched), the adapters non-zero."""
    base = tiny_image_text_model(kind, VOCAB, seed=3)
    if kind == "gemma3":  # HF's Gemma 3 image-text head applies no final cap (its text-only head does)
        base.config.text_config.final_logit_softcapping = None
    models = []
    for patched in (False, True):
        model = copy.deepcopy(base)
        if patched:
            patch_model(model)
        torch.manual_seed(4)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(model, ["q_proj", "v_proj", "gate_proj"]))
        model = get_peft_model(model, config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05)
        if patched:
            patch_lora_layers(model)
        models.append(model.train())
    return models[0], models[1]


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.mark.parametrize("kind", IMAGE_TEXT)
def test_text_calls_take_the_chunked_loss_with_hfs_numbers(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    chunked: list[int] = []
    real = kernels.fused_linear_cross_entropy

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        chunked.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "fused_linear_cross_entropy", spy)
    ref, fast = _pair(kind)
    batch = _batch()
    moe = kind == "qwen3_5_moe"
    extra = {"output_router_logits": True} if moe else {}  # the load-balancing term joins the loss, as HF adds it
    ref_out = ref(**batch, use_cache=False, **extra)
    fast_out = fast(**batch, use_cache=False, **extra)
    assert chunked == [1] and fast_out.logits is None  # no (B, T, V) logits were formed
    torch.testing.assert_close(fast_out.loss, ref_out.loss, rtol=1e-5, atol=1e-5)
    if moe:
        torch.testing.assert_close(fast_out.aux_loss, ref_out.aux_loss, rtol=1e-5, atol=1e-6)
    ref_out.loss.backward()
    fast_out.loss.backward()
    assert_same_trainable_grads(fast, ref)
    with torch.no_grad():
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        torch.testing.assert_close(fast(**inputs, use_cache=False).logits, ref(**inputs, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-4)


def test_the_head_patch_is_undone() -> None:
    model = tiny_image_text_model("qwen3_5", VOCAB, seed=3)
    patch_model(model)
    assert "forward" in model.__dict__
    unpatch_model(model)
    assert "forward" not in model.__dict__


def test_calls_with_images_video_or_audio_go_to_hfs_forward() -> None:
    assert media_inputs({"pixel_values": torch.zeros(1), "input_ids": torch.zeros(1), "token_type_ids": None}) == [
        "pixel_values"]
    assert media_inputs({"pixel_values": None, "image_grid_thw": None, "mm_token_type_ids": torch.zeros(1)}) == []
    assert media_inputs({"pixel_values_videos": 1, "input_features": 2, "labels": 3}) == ["pixel_values_videos",
                                                                                         "input_features"]
    model = tiny_image_text_model("qwen3_5", VOCAB, seed=3)
    patch_model(model)
    calls = []
    hf = type(model).forward

    def stand_in(self: torch.nn.Module, *args: Any, **kwargs: Any) -> str:
        calls.append(sorted(kwargs))
        return "hf"

    type(model).forward = stand_in  # the class's own forward, which the patched one hands image calls to
    try:
        ids = _batch()["input_ids"]
        with torch.no_grad():
            assert model(input_ids=ids, use_cache=False).logits.shape == (2, 13, VOCAB)
            assert model(input_ids=ids, pixel_values=torch.zeros(4, 384), use_cache=False) == "hf"
    finally:
        type(model).forward = hf
    assert calls == [["input_ids", "pixel_values", "use_cache"]]


def test_an_image_text_models_attention_settings_are_read_from_its_language_model() -> None:
    """Attention dropout and an attention-logit cap live in `text_config`: with either, the varlen path and the
    shared-prompt fork are refused, as for the text-only class."""
    from kestrel.model.patching import PatchFlags, prompt_sharing_refusal, runs_varlen

    model = tiny_image_text_model("gemma3", VOCAB, seed=1)
    patch_model(model, PatchFlags(varlen="reference"))
    assert runs_varlen(model) and prompt_sharing_refusal(model) is None
    model.config.text_config.attention_dropout = 0.1
    assert not runs_varlen(model)
    model.config.text_config.attention_dropout = 0.0
    model.config.text_config.attn_logit_softcapping = 50.0
    assert "caps its attention logits" in prompt_sharing_refusal(model)
