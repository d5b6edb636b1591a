"""Whether a PEFT LoRA layer can run through the fused kernels (`kestrel.kernels.lora.lora`), and why not.

Duck-typed: no peft import (it pulls in transformers). Each check names what the fused path
would compute differently from PEFT, so the caller can keep PEFT's forward and say why.
"""

from __future__ import annotations

from typing import Any

import torch


def refusal(layer: Any, adapter_name: str | None, adapter_off: bool = False) -> str:
    """Why the fused path cannot stand in for this PEFT layer ("" when it can). adapter_off: for
    the layer with its adapters disabled, where PEFT runs the base alone: what the adapter
    carries (DoRA, dropout, a bias) no longer matters, only the base does."""
    if not all(hasattr(layer, a) for a in ("lora_A", "lora_B", "scaling", "get_base_layer")):
        return f"{type(layer).__name__} is not a PEFT LoRA layer"
    if getattr(layer, "disable_adapters", False) != adapter_off:
        return "adapters are disabled" if not adapter_off else "adapters are enabled"
    if getattr(layer, "merged", False):
        return "adapter is merged into the base weight"
    active = list(getattr(layer, "active_adapters", []))
    if len(active) != 1:
        return f"{len(active)} active adapters (fused path takes exactly one)"
    name = adapter_name or active[0]
    if name != active[0]:
        return f"adapter {name!r} is not the active one ({active[0]!r})"
    if name not in layer.lora_A or name not in layer.lora_B:
        return f"adapter {name!r} has no lora_A/lora_B on this layer (not a Linear adapter)"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out (Conv1D) layout"
    if not adapter_off:
        reason = _adapter_refusal(layer, name)
        if reason:
            return reason
    base = layer.get_base_layer()
    return _base_refusal(base, layer.lora_A[name], layer.lora_B[name], layer.scaling[name])


def _adapter_refusal(layer: Any, name: str) -> str:
    """What in the adapter `name` itself the fused path does not compute ("" when nothing)."""
    if getattr(layer, "use_dora", {}).get(name, False):
        return "DoRA"
    variant = getattr(layer, "lora_variant", {}).get(name)
    if variant is not None:
        return f"LoRA variant {type(variant).__name__}"
    dropout = layer.lora_dropout[name] if name in getattr(layer, "lora_dropout", {}) else None
    if dropout is not None and not isinstance(dropout, torch.nn.Identity):
        if not (isinstance(dropout, torch.nn.Dropout) and dropout.p == 0):
            return f"lora dropout {getattr(dropout, 'p', dropout)} > 0"
    if getattr(layer, "lora_bias", {}).get(name, False) or layer.lora_B[name].bias is not None:
        return "lora_B has a bias"
    return ""


def _base_refusal(base: Any, lora_a: Any, lora_b: Any, scaling: Any) -> str:
    if not isinstance(lora_a, torch.nn.Linear) or not isinstance(lora_b, torch.nn.Linear):
        return f"adapter modules are {type(lora_a).__name__}/{type(lora_b).__name__}, not Linear"
    if lora_a.bias is not None:
        return "lora_A has a bias"
    if not isinstance(scaling, (int, float)):
        return f"scaling is a {type(scaling).__name__}, not a number"
    bias = getattr(base, "bias", None)
    if bias is not None and bias.requires_grad:
        return "base layer's bias is trainable (the fused backward gives it no gradient)"
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return f"base layer {type(base).__name__} has no 2-D weight"
    if weight.requires_grad:
        return "base weight is trainable (the fused backward gives it no gradient)"
    if weight.dtype == torch.uint8:
        qs = getattr(weight, "quant_state", None)
        if qs is None:
            return "uint8 base weight without a quant_state"
        if getattr(qs, "quant_type", None) != "nf4":
            return f"4-bit quant_type {getattr(qs, 'quant_type', None)!r} (only nf4)"
        expected = (lora_b.weight.shape[0], lora_a.weight.shape[1])
        if tuple(qs.shape) != expected:
            return f"quant_state shape {tuple(qs.shape)} != {expected}"
        return ""
    if not weight.is_floating_point() or weight.element_size() < 2:
        return f"base weight dtype {weight.dtype} (8-bit and other formats are not supported)"
    return ""
