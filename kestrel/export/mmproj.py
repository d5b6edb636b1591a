"""The vision projector file (`<name>-mmproj-f16.gguf`) llama.cpp's multimodal tools (mtmd, clip)
load next to an image-text model's language model GGUF.

    if has_mmproj(src.config): notes = write_mmproj(path, src.model_dir, src.config)

Written for the families in `kestrel.export.mmproj_families.PROJECTORS` (Gemma 3, Gemma 4, Qwen3.5,
Mistral 3): each row there is the layout llama.cpp's converter writes for it. Common to all, as the converter writes:
- architecture `clip`, the vision tower's sizes, `clip.vision.projection_dim` = the text hidden size,
  image mean/std from preprocessor_config.json (else the family's);
- names through `gguf.TensorNameMap(MODEL_ARCH.MMPROJ)` (`v.blk.0.attn_q.weight`, `mm.input_projection.weight`);
- the family's embeddings F32, other matrices F16, 1-D tensors (and scalars, as 1-D) F32;
- a family's renames (names gguf's map lacks), transforms (values), splits (one tensor to several)
  and extras (tensors from outside the tower).
The vision tower is the checkpoint's own (training leaves it frozen), so the file is the base model's.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from kestrel.export.merge import CheckpointTensors
from kestrel.export.mmproj_families import PROJECTORS, Projector



def has_mmproj(config: Any) -> bool:
    """Whether Kestrel writes a projector file for this (image-text) checkpoint."""
    return getattr(config, "vision_config", None) is not None and config.model_type in PROJECTORS


def _preprocessor(model_dir: Path) -> dict[str, Any]:
    """preprocessor_config.json, updated by processor_config.json's `image_processor` (newer checkpoints)."""
    found: dict[str, Any] = {}
    for file in ("preprocessor_config.json", "processor_config.json"):
        if (model_dir / file).is_file():
            data = json.loads((model_dir / file).read_text())
            found.update({**data, **(data.get("image_processor") or {})})
    return found


def image_stats(model_dir: Path, config: Any) -> tuple[list[float], list[float]]:
    """(mean, std) per RGB channel that pixels in [0, 1] are normalised by before the vision tower."""
    pre, (mean, std) = _preprocessor(model_dir), PROJECTORS[config.model_type].mean_std
    return pre.get("image_mean", mean), pre.get("image_std", std)


def _metadata(writer: Any, config: Any, model_dir: Path) -> list[str]:
    vision, projector, notes = config.vision_config, PROJECTORS[config.model_type], []
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    writer.add_clip_has_vision_encoder(True)
    writer.add_string(projector.type_key, projector.kind)
    writer.add_vision_projection_dim(int(config.text_config.hidden_size))
    writer.add_vision_image_size(projector.image_size(vision))
    writer.add_vision_patch_size(int(vision.patch_size))
    writer.add_vision_embedding_length(int(vision.hidden_size))
    writer.add_vision_feed_forward_length(int(vision.intermediate_size))
    writer.add_vision_block_count(_blocks(vision))
    writer.add_vision_head_count(int(getattr(vision, "num_attention_heads", None) or vision.num_heads))
    writer.add_vision_attention_layernorm_eps(projector.eps(vision))
    if projector.activation(vision) == "silu":
        writer.add_vision_use_silu(True)
    else:
        writer.add_vision_use_gelu(True)  # tanh GELU, which the towers run
    pre = _preprocessor(model_dir)
    mean, std = image_stats(model_dir, config)
    if "image_mean" not in pre:
        notes.append(f"{model_dir} has no image mean/std in its (pre)processor_config.json: the projector file uses "
                     f"{config.model_type}'s ({mean}, {std})")
    writer.add_vision_image_mean(mean)
    writer.add_vision_image_std(std)
    for key, value in projector.pooling(config, pre).items():
        writer.add_uint32(key, value)
    return notes


def _blocks(vision: Any) -> int:
    return int(getattr(vision, "num_hidden_layers", None) or vision.depth)


def transform(projector: Projector, gguf_name: str, w: np.ndarray, vision: Any) -> np.ndarray:
    """Hugging Face's values -> clip's (the family's transforms, by the file's tensor name)."""
    fn = projector.transforms.get(re.sub(r"^v\.blk\.\d+\.", "v.blk.{bid}.", gguf_name))
    return w if fn is None else fn(w, vision)


def missing_part(model_dir: Path, config: Any) -> str | None:
    """Why llama.cpp could not load a projector file of this checkpoint (None: it could)."""
    return PROJECTORS[config.model_type].missing(model_dir)


def _gguf_name(projector: Projector, name_map: gguf.TensorNameMap, name: str) -> str | None:
    base, _, suffix = name.rpartition(".")
    if base in projector.renames:
        return f"{projector.renames[base]}.{suffix}"
    return name_map.get_name(name, try_suffixes=projector.suffixes)


def _encode(projector: Projector, gguf_name: str, w: np.ndarray) -> np.ndarray:
    if w.ndim == 0:
        return w.reshape(1).astype(np.float32)  # scalars (clip ranges) as 1-D, as the converter writes them
    if w.ndim == 1 or gguf_name.startswith(projector.f32):
        return w.astype(np.float32)
    return w.astype(np.float16)


def write_mmproj(path: Path, model_dir: Path, config: Any) -> list[str]:
    """Write the projector file of the image-text checkpoint in `model_dir`; returns notes."""
    logging.getLogger("gguf").setLevel(logging.WARNING)
    checkpoint, projector = CheckpointTensors(model_dir), PROJECTORS[config.model_type]
    name_map = gguf.TensorNameMap(gguf.MODEL_ARCH.MMPROJ, _blocks(config.vision_config))
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    try:
        notes = _metadata(writer, config, model_dir)
        for name in checkpoint.names():
            mapped = projector.source_name(name)
            if mapped is None:
                continue
            gguf_name = _gguf_name(projector, name_map, mapped)
            if gguf_name is None:
                raise ValueError(f"no projector-file name for tensor {name} of {model_dir}")
            w = transform(projector, gguf_name, checkpoint.get(name).float().numpy(), config.vision_config)
            split = projector.splits.get(gguf_name)
            for part, value in (split(w) if split else {gguf_name: w}).items():
                writer.add_tensor(part, _encode(projector, part, value))
        for gguf_name, w in projector.extras(checkpoint, config, model_dir).items():
            writer.add_tensor(gguf_name, _encode(projector, gguf_name, w))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return notes
