"""Attaching LoRA adapters through PEFT (the saved adapter is a standard PEFT folder)."""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from kestrel.config import ALL_LINEAR, LoraSettings
from kestrel.errors import ConfigError
from kestrel.model.multimodal import lora_targets
from kestrel.model.patching import patch_lora_layers
from kestrel.model.registry import family_for
from kestrel.model.safe_weights import refuse_pickled

log = logging.getLogger("kestrel")


def adapter_folder(path: str) -> Path:
    """The PEFT folder named by `path`: the folder itself or its `adapter/` (a finished run)."""
    folder = Path(path).expanduser()
    for candidate in (folder, folder / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise ConfigError(
        f"lora.init_from: {folder} holds no adapter_config.json (nor does {folder / 'adapter'}); "
        "give a PEFT adapter folder or the folder of a finished LoRA run"
    )


# A mixture-of-experts block keeps its experts' MLP weights as 3-D parameters, not linears: the MLP
# targets name them there, through PEFT's parameter targets (`lora.ParamWrapper`).
_MLP_NAMES = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def expert_parameters(model: nn.Module, targets: list[str]) -> list[str]:
    """PEFT `target_parameters` (e.g. `mlp.experts.gate_up_proj`) for the MLP names in `targets`
    on a mixture-of-experts model; empty for a dense one."""
    spec = family_for(model.config)
    if spec is None or spec.moe is None:
        return []
    stored = {name.rsplit(".", 1)[-1] for name, _ in model.named_parameters() if ".experts." in name}
    wanted = dict.fromkeys(_MLP_NAMES[t] for t in targets if t in _MLP_NAMES)
    return [f"experts.{name}" for name in wanted if name in stored]


def every_linear(model: nn.Module, targets: list[str]) -> list[str]:
    """`targets`, plus the family's other linears (`FamilySpec.extra_lora_targets`, e.g. Qwen3.5's
    linear-attention projections) present in `model` when `targets` hold all seven of
    `ALL_LINEAR`: what "every linear" means for the family. The benches give the baselines the
    same list, so every system trains the same adapters."""
    spec = family_for(model.config)
    if spec is None or not set(ALL_LINEAR) <= set(targets):
        return list(targets)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return list(targets) + [t for t in spec.extra_lora_targets if t not in targets and t in present]


def _load_trainable(model: nn.Module, path: str) -> nn.Module:
    from peft import PeftModel

    folder = adapter_folder(path)
    refuse_pickled(folder)
    try:
        return PeftModel.from_pretrained(model, str(folder), is_trainable=True)
    except (RuntimeError, ValueError, KeyError) as exc:  # shape or module mismatch with this model
        raise ConfigError(f"lora.init_from: the adapter in {folder} does not fit this model ({exc})") from exc


def attach_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Wrap `model` in a PEFT LoRA model on `settings.targets` (or load the trained adapter named
    by `settings.init_from`, trainable) and route its layers through the fused LoRA kernels. Only
    the adapter weights are trainable afterwards."""
    from peft import LoraConfig, get_peft_model

    if settings.init_from:
        peft_model = _load_trainable(model, settings.init_from)
        patched = patch_lora_layers(peft_model)
        log.info("LoRA from %s; %d layers on the fused path", settings.init_from, patched)
        return peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = list(settings.targets)
    experts = expert_parameters(model, targets)
    missing = [t for t in targets if t not in present and not (experts and t in _MLP_NAMES)]
    if missing:
        raise ConfigError(
            f"lora.targets {missing} are not modules of this model; it has e.g. "
            + ", ".join(sorted(n for n in present if n.endswith("proj"))[:10])
        )
    targets = every_linear(model, targets)
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        # an image-text model: its language model only; a MoE's expert MLPs: parameter targets
        target_modules=lora_targets(model, [t for t in targets if t in present]),
        target_parameters=experts or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    patched = patch_lora_layers(peft_model)
    log.info("LoRA r=%d on %s%s; %d layers on the fused path", settings.r, ",".join(targets),
             f" (experts: {', '.join(experts)})" if experts else "", patched)
    return peft_model


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
