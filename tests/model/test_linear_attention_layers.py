"""Qwen3.5's decoder layers on Kestrel's forward (the `decoder_layer` level): a layer runs its token mixer
(gated-delta-rule linear attention or gated full attention, `FamilySpec.linear_attention_attr`), then the
MLP, with the residual sums in place, and a checkpoint's recompute skips what its thrown-away output needs
(the MLP's down product; under offloaded checkpointing the gate product comes back from host memory).
Against the unpatched Hugging Face model: loss and LoRA gradients, checkpointed both ways, on the dense
family and on Qwen3.5-MoE (whose sparse block runs through the same layer forward)."""

from __future__ import annotations

import copy

import pytest
import torch

from kestrel.model.patching import patch_lora_layers, patch_model, unpatch_model
from kestrel.model.registry import family_of
from kestrel.recompute.checkpoint import set_gradient_checkpointing
from tests.model.test_linear_attention_packing import _packed
from tests.model.test_model_forward import mlp_discards
from tests.model.test_patching import VOCAB, _lora
from tests.support.compare import assert_same_loss_and_grads
from tests.support.tiny import tiny_model

FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text"]


def _batch(padded: bool) -> dict[str, torch.Tensor]:
    """input_ids and labels (2, 21); with `padded`, the second row right-padded after 13 tokens."""
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[:, :2] = -100
    batch = {"input_ids": ids, "labels": labels}
    if padded:
        mask = torch.ones_like(ids)
        mask[1, 13:] = 0
        labels[1, 13:] = -100
        batch["attention_mask"] = mask
    return batch


def test_every_decoder_layer_runs_kestrels_forward_and_undo_restores_hfs() -> None:
    model = tiny_model("qwen3_5_text", VOCAB, seed=1)
    spec = family_of("qwen3_5_text")
    assert spec is not None and "decoder_layer" in spec.levels
    layers = [m for m in model.modules() if type(m).__name__ == spec.decoder_layer_class]
    kinds = {type(getattr(layer, "linear_attn", getattr(layer, "self_attn", None))).__name__ for layer in layers}
    assert kinds == {spec.linear_attention_class, spec.attention_class}  # one layer of each kind
    patch_model(model)
    assert all("forward" in layer.__dict__ for layer in layers)
    unpatch_model(model)
    assert not any("forward" in layer.__dict__ for layer in layers)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["off", "standard", "offload"])
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_checkpointed_layers_give_hfs_loss_and_lora_gradients(family: str, mode: str, padded: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    discards = mlp_discards(monkeypatch)
    base = tiny_model(family, VOCAB, seed=3)
    ref = _lora(copy.deepcopy(base), seed=4)
    patch_model(base)
    fast = _lora(base, seed=4)
    assert patch_lora_layers(fast) > 0
    set_gradient_checkpointing(fast, mode, "off")
    ref.train(), fast.train()
    batch = _batch(padded)
    assert_same_loss_and_grads(fast, ref, batch)
    dense = sum(hasattr(getattr(m, "gate_proj", None), "lora_A") for m in fast.modules())
    if family == "qwen3_5_moe_text":
        return  # its MLP is the sparse block (the shared expert carries no adapters: PEFT's names miss it)
    assert dense == 2  # both layers' MLPs: after a linear-attention mixer and after full attention
    # checkpointed: a first pass that keeps its output, then a recompute that throws it away
    assert discards == ([False] * dense if mode == "off" else [False] * dense + [True] * dense)


def test_checkpointed_packed_rows_give_the_same_gradients_as_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed rows (HF's own layers would carry state across samples, so the reference is the patched
    model without checkpointing): offloaded checkpointing recomputes each layer to the same numbers."""
    ids, positions, _ = _packed([(9, 20, 5), (12, 22)])
    labels = ids.clone()
    labels[positions == 0] = -100
    grads = {}
    for mode in ("off", "offload"):
        base = tiny_model("qwen3_5_text", VOCAB, seed=6)
        patch_model(base)
        model = _lora(base, seed=7)
        patch_lora_layers(model)
        set_gradient_checkpointing(model, mode, "off")
        model.train()
        model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss.backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads["off"].keys() == grads["offload"].keys()
    for name, grad in grads["off"].items():
        torch.testing.assert_close(grads["offload"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
