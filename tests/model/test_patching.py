"""Patched vs unpatched Hugging Face models, same weights and batch, on every family."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kestrel.model.forwards import shift_labels
from kestrel.model.patching import PatchFlags, patch_lora_layers, patch_model, unpatch_model
from kestrel.model.registry import SUPPORTED
from tests.support.compare import assert_same_trainable_grads
from tests.support.tiny import tiny_model

VOCAB = 512


def _batch(seed: int = 0, b: int = 2, t: int = 19) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    return ids, labels


def _hf_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    targets = shift_labels(labels)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _lora(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # non-zero, so the adapter changes the output
    return peft_model


@pytest.mark.parametrize("family", SUPPORTED)
def test_patched_logits_and_loss_match_hf(family: str) -> None:
    ref = tiny_model(family, VOCAB, seed=1)
    fast = copy.deepcopy(ref)
    handle = patch_model(fast)
    assert handle is not None and handle.count > 0
    ids, labels = _batch()
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
        fast_logits = fast(input_ids=ids).logits  # the config's use_cache=True: HF's stack forward
        torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fast(input_ids=ids, use_cache=False).logits, ref_logits, rtol=1e-4, atol=1e-4)
        fast_loss = fast(input_ids=ids, labels=labels, use_cache=False).loss
        ref_loss = ref(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(fast_loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_loss, _hf_loss(ref_logits, labels), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", SUPPORTED)
def test_patched_lora_gradients_match_hf(family: str) -> None:
    base = tiny_model(family, VOCAB, seed=2)
    ref = _lora(copy.deepcopy(base), seed=3)
    fast_base = copy.deepcopy(base)
    patch_model(fast_base)
    fast = _lora(fast_base, seed=3)
    assert patch_lora_layers(fast) > 0
    ids, labels = _batch(1)
    ref.train(), fast.train()
    ref(input_ids=ids, labels=labels).loss.backward()
    fast(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    assert_same_trainable_grads(fast, ref)


def test_undo_restores_every_forward() -> None:
    model = tiny_model("qwen3", VOCAB, seed=4)
    ids, _ = _batch(2)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    patch_model(model)
    patched = {type(m).__name__ for m in model.modules() if "forward" in m.__dict__}
    assert {"Qwen3Model", "Qwen3Attention", "Qwen3ForCausalLM"} <= patched
    unpatch_model(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert model.model.forward.__func__ is type(model.model).forward
    assert getattr(model, "kestrel_patch", None) is None
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, before, rtol=0, atol=0)


def test_flags_choose_what_is_patched() -> None:
    model = tiny_model("llama", VOCAB)
    handle = patch_model(model, PatchFlags(attention=False, mlp=False, decoder_layer=False, model=False, causal_lm=False))
    patched = {type(m).__name__ for m in model.modules() if "forward" in m.__dict__}
    assert patched == {"LlamaRMSNorm"} and handle.count == 2 * 2 + 1
    handle.undo()
    del model.kestrel_patch
    handle = patch_model(model, PatchFlags(rms_norm=False, attention=False, mlp=False, decoder_layer=False, causal_lm=False))
    patched = {type(m).__name__ for m in model.modules() if "forward" in m.__dict__}
    assert patched == {"LlamaModel"} and handle.count == 1


def test_unknown_family_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt2", vocab_size=64, n_embd=32, n_layer=1, n_head=2)
    model = AutoModelForCausalLM.from_config(cfg)
    with caplog.at_level("WARNING", logger="kestrel"):
        assert patch_model(model) is None
    assert "no fast path for model type 'gpt2'" in caplog.text
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_packed_rows_equal_separate_samples() -> None:
    """Two samples packed in one row (positions restarting) give the same per-token loss sum."""
    model = tiny_model("llama", VOCAB, seed=5)
    patch_model(model)
    a = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    b = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        la = model(input_ids=a, labels=a, num_items_in_batch=1, use_cache=False).loss
        lb = model(input_ids=b, labels=b, num_items_in_batch=1, use_cache=False).loss
        packed = torch.cat([a, b], dim=1)
        labels = packed.clone()
        labels[0, 9] = -100  # b's first token is never predicted from a
        positions = torch.cat([torch.arange(9), torch.arange(7)]).unsqueeze(0)
        lp = model(input_ids=packed, labels=labels, position_ids=positions, num_items_in_batch=1, use_cache=False).loss
    torch.testing.assert_close(lp, la + lb, rtol=1e-5, atol=1e-5)


def test_residual_add_writes_into_a_fresh_update_and_keeps_both_gradients() -> None:
    from kestrel.model.forwards import _residual_add

    w = torch.randn(4, 4, requires_grad=True)
    residual = torch.randn(2, 4, requires_grad=True)
    update = residual.detach() @ w  # a sublayer's fresh output: written into
    out = _residual_add(residual, update)
    assert out is update
    torch.testing.assert_close(out, residual + residual.detach() @ w)
    out.pow(2).sum().backward()
    expected = 2 * (residual + residual @ w).detach()
    torch.testing.assert_close(residual.grad, expected)
    torch.testing.assert_close(w.grad, residual.detach().t() @ expected)
    # A view, a leaf or a dtype change: a new tensor, the operands untouched.
    base = residual.detach() @ w
    for upd in (base[:, :], torch.randn(2, 4, requires_grad=True), (residual.detach() @ w).double()):
        before = upd.detach().clone()
        assert _residual_add(residual, upd) is not upd and torch.equal(upd.detach(), before)


@pytest.mark.parametrize("family", SUPPORTED)
def test_every_adapted_linear_runs_the_fused_path(family: str) -> None:
    # A base bias (Qwen2's Q/K/V, gpt-oss's attention) once sent those layers to PEFT's own forward, a
    # slower path with an autograd add per projection; nothing in a supported family may fall back.
    from kestrel.model.fused_lora import fused_lora_weights

    from kestrel.config import ALL_LINEAR
    from kestrel.model.lora import every_linear

    fast_base = tiny_model(family, VOCAB, seed=2)
    patch_model(fast_base)
    # The product's "every linear": the seven, plus the family's own (Qwen3.5's linear-attention projections)
    fast = get_peft_model(fast_base, LoraConfig(r=8, lora_alpha=16, target_modules=every_linear(fast_base, list(ALL_LINEAR))))
    patch_lora_layers(fast)
    # PEFT layers over a linear (a mixture's experts are adapted as parameters, kestrel.model.moe)
    adapted = {name: m for name, m in fast.named_modules()
               if hasattr(m, "lora_A") and isinstance(getattr(m.get_base_layer(), "weight", None), torch.Tensor)}
    biased = [name for name, m in adapted.items() if getattr(m.get_base_layer(), "bias", None) is not None]
    assert adapted
    assert [name for name, m in adapted.items() if fused_lora_weights(m) is None] == []
    if family == "qwen2":
        assert len(biased) == 3 * fast.config.num_hidden_layers  # the test reaches the biased layers
    if family == "qwen3_5_text":
        assert any(name.endswith("in_proj_qkv") for name in adapted)  # and the family's own linears
