"""Image-text checkpoints (Gemma 3 4B+, Gemma 4, Qwen3.5, Mistral 3) fine-tuned on text.

Such a checkpoint loads as its image-text class (`...ForConditionalGeneration`), so the vision
tower stays in the model, untouched, and a later step can feed it images through the same model.
Training on text touches only the language model: the decoder stack of the family's
`FamilySpec.model_class` (found by class, wherever the architecture nests it) and the output
head. Everything else (vision tower, projector, audio tower) is frozen, and LoRA targets only
the language model's projections (`q_proj` is also the name of a vision attention projection).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kestrel.model.registry import FamilySpec, family_for, is_image_text

HEAD = "lm_head"


def language_stack(model: nn.Module, spec: FamilySpec | None = None) -> tuple[str, nn.Module]:
    """(qualified name, module) of the decoder stack of `model` (a causal LM, an image-text
    model or a PEFT wrapper of either): the module of class `spec.model_class`."""
    spec = spec or family_for(_config(model))
    if spec is None:
        raise ValueError(f"no registered family for model type {_config(model).model_type!r}")
    for name, module in model.named_modules():
        if type(module).__name__ == spec.model_class:
            return name, module
    raise ValueError(f"{type(model).__name__} holds no {spec.model_class}")


def _config(model: nn.Module) -> Any:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.config


def in_language_model(name: str, stack_name: str) -> bool:
    """Whether the parameter or module `name` belongs to the language model: under its decoder
    stack, or the output head."""
    return name.startswith(stack_name + ".") or HEAD in name.split(".")


def freeze_outside_language_model(model: nn.Module) -> int:
    """requires_grad off for every parameter outside the language model; returns how many
    parameters that froze (0 for a text-only model)."""
    if not is_image_text(_config(model)):
        return 0
    stack_name, _ = language_stack(model)
    frozen = 0
    for name, param in model.named_parameters():
        if not in_language_model(name, stack_name):
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def causal_lm_name(name: str) -> str:
    """A tensor or module name of an image-text checkpoint as the family's text-only causal LM
    names it: the `language_model` segment dropped (`language_model.model.layers.0...`, as HF
    saves Gemma 3 and Mistral 3, and `model.language_model.layers.0...`, as it saves Qwen3.5 and
    names the modules at run time, both become `model.layers.0...`). Other names are unchanged."""
    return ".".join(part for part in name.split(".") if part != "language_model")


def is_language_tensor(name: str) -> bool:
    """Whether checkpoint tensor `name` of an image-text model belongs to its language model."""
    parts = name.split(".")
    return "language_model" in parts or parts[0] == HEAD


def lora_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """PEFT `target_modules` for LoRA on `targets` (short names such as "q_proj"): the names
    themselves for a text-only model; for an image-text model the qualified names of the
    language model's modules of those names, so no vision projection gets an adapter."""
    if not is_image_text(_config(model)):
        return list(targets)
    stack_name, _ = language_stack(model)
    wanted = set(targets)
    return [
        name for name, _ in model.named_modules()
        if name.rsplit(".", 1)[-1] in wanted and name.startswith(stack_name + ".")
    ]


# Keyword names of a call's images, video or audio (HF's image-text forwards: pixel_values,
# pixel_values_videos, image_grid_thw, input_features, image_position_ids...).
_MEDIA_WORDS = ("pixel", "image", "video", "audio", "input_features")


def media_inputs(kwargs: dict[str, Any]) -> list[str]:
    """The keywords of a forward call that carry images, video or audio (not None): a call with any
    is for HF's own image-text forward; one with none is text."""
    return [name for name, value in kwargs.items()
            if value is not None and any(word in name for word in _MEDIA_WORDS)]
