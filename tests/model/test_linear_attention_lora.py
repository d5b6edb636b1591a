"""Qwen3.5's linear-attention layers with LoRA on their input projections: in_proj_qkv and
in_proj_z run as one fused Function (one input gradient, no autograd add), with HF+PEFT's logits
and gradients."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model

from kestrel import kernels
from kestrel.config import ALL_LINEAR
from kestrel.model import fused_lora
from kestrel.model.patching import patch_lora_layers, patch_model
from kestrel.model.registry import family_of
from tests.support.compare import assert_same_trainable_grads
from tests.support.tiny import tiny_model

VOCAB = 128


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(3)
    targets = [*ALL_LINEAR, *family_of("qwen3_5_text").extra_lora_targets]
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft_model


def test_in_proj_qkv_and_z_run_as_one_function_with_hfs_numbers(monkeypatch) -> None:
    base = tiny_model("qwen3_5_text", VOCAB, seed=2)
    ref = _lora(copy.deepcopy(base))
    fast_base = copy.deepcopy(base)
    patch_model(fast_base)
    fast = _lora(fast_base)
    patch_lora_layers(fast)

    groups: list[int] = []
    real = kernels.lora_projections

    def spy(x, *ws):
        groups.append(len(ws))
        return real(x, *ws)

    monkeypatch.setattr(fused_lora.kernels, "lora_projections", spy)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 21), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    ref.train(), fast.train()
    want = ref(input_ids=ids, labels=labels)
    got = fast(input_ids=ids, labels=labels, use_cache=False)
    want.loss.backward()
    got.loss.backward()

    linear_layers = sum(t == "linear_attention" for t in base.config.layer_types)
    assert linear_layers and groups.count(2) == linear_layers  # one Function per linear-attention layer
    with torch.no_grad():  # the fused loss keeps no logits: a pass without labels gives them
        torch.testing.assert_close(fast(input_ids=ids, use_cache=False).logits, ref(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    assert_same_trainable_grads(fast, ref, rtol=1e-3, atol=1e-5)
