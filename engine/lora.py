"""Attaching LoRA adapters through PEFT (the saved adapter is a standard PEFT folder)."""

from __future__ import annotations

import logging

from torch import nn

from engine.config import LoraSettings
from engine.errors import ConfigError
from engine.patching import patch_lora_layers

log = logging.getLogger("kestrel")


def attach_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Wrap `model` in a PEFT LoRA model on `settings.targets` and route its layers through the
    fused LoRA kernels. Only the adapter weights are trainable afterwards."""
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in settings.targets if t not in present]
    if missing:
        raise ConfigError(
            f"lora.targets {missing} are not modules of this model; it has e.g. "
            + ", ".join(sorted(n for n in present if n.endswith("proj"))[:10])
        )
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    patched = patch_lora_layers(peft_model)
    log.info("LoRA r=%d on %s; %d layers on the fused path", settings.r, ",".join(settings.targets), patched)
    return peft_model


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
