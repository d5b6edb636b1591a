"""Tiny image-text models (Gemma 3 4B+, Mistral 3, Qwen3.5, Qwen3.5-MoE and Gemma 4 shapes), from a config.

Each keeps its real checkpoint's structure (the vision tower class, the projector, the language
model nested where the architecture nests it) at a size a CPU test builds in a second. The
language model is the family's tiny config from `tests.support.tiny`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel

from tests.support.tiny import tiny_config

# Qwen3.5's vision tower (Qwen3.5-MoE's is the same).
_QWEN3_5_VISION: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, depth=1, num_heads=2, out_hidden_size=128,
                                       patch_size=8)

# model_type of the image-text checkpoint -> (its language model's family, vision config, extras)
IMAGE_TEXT: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "gemma3": ("gemma3_text", dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
               dict(mm_tokens_per_image=4)),
    "mistral3": ("mistral", dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, image_size=64, patch_size=8, head_dim=16), {}),  # 16 merged tokens: clip's minimum is 8
    "qwen3_5": ("qwen3_5_text", _QWEN3_5_VISION, {}),
    "qwen3_5_moe": ("qwen3_5_moe_text", _QWEN3_5_VISION, {}),
    "gemma4": ("gemma4_text", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=16, global_head_dim=16, patch_size=8), {}),
}


def tiny_image_text_config(model_type: str, vocab_size: int) -> PretrainedConfig:
    family, vision, extra = IMAGE_TEXT[model_type]
    text = tiny_config(family, vocab_size).to_dict()
    tie = text.get("tie_word_embeddings", False)
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, tie_word_embeddings=tie, **extra)


def tiny_image_text_model(model_type: str, vocab_size: int, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised image-text model, deterministic for a given seed."""
    config = tiny_image_text_config(model_type, vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    # Hugging Face zero-initialises some projectors (Gemma 3's input projection): every image would
    # embed to zeros, and a projector-file check could not fail. Random values make tests see it.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "projector" in name and param.dim() == 2 and not param.any():
                param.normal_(0.0, param.shape[0] ** -0.5)
    return model.eval()
