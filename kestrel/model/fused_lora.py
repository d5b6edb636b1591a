"""Which PEFT LoRA layers run through Kestrel's fused LoRA kernels (`kestrel.kernels.lora`), and
the forwards that send them there: one projection, or several of one input as one Function."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from kestrel import kernels

log = logging.getLogger("kestrel")
_NOTICED: set[str] = set()


def _notice_once(message: str) -> None:
    if message not in _NOTICED:
        _NOTICED.add(message)
        log.warning(message)


def fused_lora_weights(layer: nn.Module) -> Any | None:
    """`kestrel.kernels.LoRAWeights` for a PEFT LoRA layer that the fused path can run now, else None.

    With adapters disabled (the DPO / KTO / GRPO reference pass) the weights have the adapter
    off (s = 0, `LoRAWeights.adapter_off`): the base runs through the same kernels as the policy.
    None for a plain linear or a merged layer; None with a one-time notice when PEFT carries
    something the kernel does not support (dropout > 0, a trainable bias, DoRA, several active adapters).
    The answer is cached on the layer for each state it depends on (a run switches between
    enabled and disabled every step), because this runs for every projection of every step.
    """
    if not hasattr(layer, "lora_A"):
        return None
    active = tuple(layer.active_adapters)
    state = (active, layer.merged, layer.disable_adapters, tuple(layer.scaling.get(a) for a in active))
    cached = layer.__dict__.setdefault("_kestrel_fused", {})
    if state in cached:
        return cached[state]
    weights = None
    if not state[1] and len(state[0]) == 1:
        weights, reason = kernels.LoRAWeights.from_peft(layer, state[0][0], adapter_off=bool(state[2]))
        if weights is None:
            _notice_once(f"fused LoRA kernel off for some layers ({reason}); using PEFT's path for them")
    cached[state] = weights
    return weights


def lora_linear_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT LoRA linear: y = x W^T + s (x A^T) B^T through the fused kernel when possible."""
    weights = fused_lora_weights(self) if not args and not kwargs else None
    if weights is None:
        return type(self).forward(self, x, *args, **kwargs)
    return kernels.lora_linear(x, weights)


def project_together(x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """Each of `layers` applied to x (..., in): as one `kernels.lora_projections` (one shrink
    product, one dA product, the input gradients summed in one buffer rather than by autograd's
    adds) when all of them are on the fused path, else one call each."""
    fused = [fused_lora_weights(layer) for layer in layers]
    if all(w is not None for w in fused):
        return kernels.lora_projections(x, *fused)
    return tuple(layer(x) for layer in layers)
