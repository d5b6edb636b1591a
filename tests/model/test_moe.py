"""Mixture-of-experts families (Qwen3-MoE, gpt-oss, Qwen3.5-MoE): patched vs unpatched Hugging Face,
LoRA on the experts through PEFT's parameter targets, and the router's load-balancing loss."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kestrel.model.moe import expert_projections
from kestrel.model.patching import PatchFlags, patch_lora_layers, patch_model
from kestrel.model.registry import family_of
from tests.support.compare import assert_same_trainable_grads
from tests.support.tiny import tiny_model

VOCAB = 512
MOE = ("qwen3_moe", "gpt_oss", "qwen3_5_moe_text")
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Qwen3-MoE's mlp_only_layers: a dense MLP in layer 1, so both MLP kinds run side by side.
MIXED = {"qwen3_moe": dict(mlp_only_layers=[1])}


def _batch(seed: int = 0, b: int = 2, t: int = 19) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, :4] = 0  # a left-padded row: padding is left out of the aux loss
    labels[1, :4] = -100
    return ids, labels, mask


def _lora(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """LoRA on attention (linear attention's projections too), the dense or shared-expert MLP and the experts."""
    torch.manual_seed(seed)
    extra = list(family_of(model.config.model_type).extra_lora_targets)
    cfg = LoraConfig(r=8, lora_alpha=16, target_parameters=EXPERT_PARAMS,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *extra])
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft_model


@pytest.mark.parametrize("stack", ["kestrel", "hf"])
@pytest.mark.parametrize("family", MOE)
def test_moe_logits_loss_and_aux_match_hf(family: str, stack: str) -> None:
    """The routers' sums for the aux loss: Kestrel's stack adds them into the stats the head hands it; with
    the stack left to HF (`PatchFlags(model=False)`), HF's stack records the routers' logits instead."""
    ref = tiny_model(family, VOCAB, seed=1, **MIXED.get(family, {}))
    ref.config.output_router_logits = True  # HF then adds coef * aux to the loss
    fast = copy.deepcopy(ref)
    patch_model(fast, PatchFlags(model=stack == "kestrel"))
    ids, labels, mask = _batch()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)
        got = fast(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        plain = fast(input_ids=ids, attention_mask=mask, use_cache=False)
    torch.testing.assert_close(plain.logits[mask.bool()], want.logits[mask.bool()], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
    assert got.aux_loss > 0


@pytest.mark.parametrize("family", MOE)
def test_moe_aux_loss_is_reported_outside_the_loss_by_default(family: str) -> None:
    """output_router_logits off (the configs' default): the loss is HF's language-model loss alone,
    and the aux loss still comes back (the training metric), equal to the one HF computes when asked."""
    ref = tiny_model(family, VOCAB, seed=1)
    assert not ref.config.output_router_logits
    fast = copy.deepcopy(ref)
    patch_model(fast)
    ids, labels, mask = _batch()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)
        want_aux = ref(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        got = fast(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    assert want.aux_loss is None and got.aux_loss is not None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.aux_loss, want_aux, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", MOE)
def test_moe_lora_on_experts_gradients_match_hf(family: str) -> None:
    base = tiny_model(family, VOCAB, seed=2, **MIXED.get(family, {}))
    ref = _lora(copy.deepcopy(base), seed=3)
    fast_base = copy.deepcopy(base)
    patch_model(fast_base)
    fast = _lora(fast_base, seed=3)
    patch_lora_layers(fast)
    spec = family_of(family)
    blocks = [m for m in fast.modules() if type(m).__name__ == spec.moe.block_class]
    assert blocks and all(expert_projections(b.experts, spec.moe)[0].lora_a is not None for b in blocks)  # the grouped path
    if spec.moe.shared_expert:  # the shared expert on the fused LoRA MLP forward
        assert all("forward" in b.shared_expert.__dict__ and hasattr(b.shared_expert.gate_proj, "lora_A") for b in blocks)
    ids, labels, mask = _batch(1)
    ref.train(), fast.train()
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    fast(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    assert_same_trainable_grads(fast, ref, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("family", MOE)
def test_moe_lora_on_experts_trains(family: str) -> None:
    model = tiny_model(family, VOCAB, seed=4)
    patch_model(model)
    model = _lora(model, seed=5)
    patch_lora_layers(model)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, labels, _ = _batch(2, b=2, t=16)
    losses = []
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n and p.requires_grad}
    for _ in range(20):
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0], losses
    assert before and all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)


# Linear attention's state would run across packed samples: training refuses packing there.
@pytest.mark.parametrize("family", [f for f in MOE if not family_of(f).linear_attention_class])
def test_moe_packed_rows_equal_separate_samples(family: str) -> None:
    """Two samples packed in one row (positions restarting) give the loss sum of the two alone,
    for gpt-oss too, whose HF forward ignores the restart."""
    model = tiny_model(family, VOCAB, seed=6)
    patch_model(model)
    a = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    b = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        la = model(input_ids=a, labels=a, num_items_in_batch=1, use_cache=False).loss
        lb = model(input_ids=b, labels=b, num_items_in_batch=1, use_cache=False).loss
        packed = torch.cat([a, b], dim=1)
        labels = packed.clone()
        labels[0, 9] = -100
        positions = torch.cat([torch.arange(9), torch.arange(12)]).unsqueeze(0)
        lp = model(input_ids=packed, labels=labels, position_ids=positions, num_items_in_batch=1, use_cache=False).loss
    torch.testing.assert_close(lp, la + lb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", MOE)
def test_attach_lora_puts_the_mlp_targets_on_the_experts(family: str) -> None:
    from kestrel.config import LoraSettings
    from kestrel.model.lora import attach_lora

    model = tiny_model(family, VOCAB, seed=7)
    patch_model(model)
    peft_model = attach_lora(model, LoraSettings(r=4, alpha=8))  # the default targets: every linear
    trained = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    for layer in range(model.config.num_hidden_layers):
        if type(model.model.layers[layer].mlp).__name__ != family_of(family).moe.block_class:
            continue
        assert any(f"layers.{layer}.mlp.experts" in n and "lora_A" in n for n in trained)
        assert sum(f"layers.{layer}.mlp.experts" in n for n in trained) == 4  # A and B of gate_up and down
    assert any("q_proj.lora_A" in n for n in trained)
