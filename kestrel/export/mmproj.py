"""The vision projector file (`<name>-mmproj-f16.gguf`) llama.cpp's multimodal tools (mtmd, clip)
load next to an image-text model's language model GGUF.

    if has_mmproj(src.config): notes = write_mmproj(path, src.model_dir, src.config)

Written for the projectors llama.cpp's `convert_hf_to_gguf.py --mmproj` writes and Kestrel maps:
Gemma 3 (SigLIP vision tower + `gemma3` projector). Layout, as llama.cpp's converter writes it:
- architecture `clip`, `clip.projector_type` = gemma3, the vision tower's sizes, image mean/std (from
  preprocessor_config.json, else SigLIP's 0.5), `clip.vision.projection_dim` = the text hidden size;
- names through `gguf.TensorNameMap(MODEL_ARCH.MMPROJ)` (`v.blk.0.attn_q.weight`, `mm.input_projection.weight`);
  SigLIP's pooling head (`head.*`) is not used by Gemma 3 and is left out;
- the projector's soft-embedding norm scales by (1 + w): 1 is added, as for the language model's norms;
- embeddings (patch, position) F32, the input projection and the other matrices F16, 1-D tensors F32.
The vision tower is the checkpoint's own (training leaves it frozen), so the file is the base model's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from kestrel.export.merge import CheckpointTensors

PROJECTORS = {"gemma3": gguf.VisionProjectorType.GEMMA3}  # image-text model_type -> llama.cpp projector
_SIGLIP_MEAN_STD = [0.5, 0.5, 0.5]


def has_mmproj(config: Any) -> bool:
    """Whether Kestrel writes a projector file for this (image-text) checkpoint."""
    return getattr(config, "vision_config", None) is not None and config.model_type in PROJECTORS


def _vision_name(name: str) -> str | None:
    """A checkpoint name under the converter's (`vision_tower.vision_model.*`, `multi_modal_projector.*`),
    or None for tensors outside the projector file."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower."):]
    if not name.startswith(("vision_tower.", "multi_modal_projector.")) or ".head." in name:
        return None
    return name.replace("_weight", ".weight")


def _preprocessor(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def image_stats(model_dir: Path) -> tuple[list[float], list[float]]:
    """(mean, std) per RGB channel that pixels in [0, 1] are normalised by before the vision tower."""
    pre = _preprocessor(model_dir)
    return pre.get("image_mean", _SIGLIP_MEAN_STD), pre.get("image_std", _SIGLIP_MEAN_STD)


def _metadata(writer: Any, config: Any, model_dir: Path) -> list[str]:
    vision, notes = config.vision_config, []
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(PROJECTORS[config.model_type])
    writer.add_vision_projection_dim(int(config.text_config.hidden_size))
    writer.add_vision_image_size(int(vision.image_size))
    writer.add_vision_patch_size(int(vision.patch_size))
    writer.add_vision_embedding_length(int(vision.hidden_size))
    writer.add_vision_feed_forward_length(int(vision.intermediate_size))
    writer.add_vision_block_count(int(vision.num_hidden_layers))
    writer.add_vision_head_count(int(vision.num_attention_heads))
    writer.add_vision_attention_layernorm_eps(float(getattr(vision, "layer_norm_eps", 1e-6)))
    writer.add_vision_use_gelu(True)
    pre = _preprocessor(model_dir)
    if not pre:
        notes.append(f"{model_dir} has no preprocessor_config.json: the projector file uses SigLIP's image mean/std (0.5)")
    mean, std = image_stats(model_dir)
    writer.add_vision_image_mean(mean)
    writer.add_vision_image_std(std)
    tokens = int(pre.get("image_seq_length", getattr(config, "mm_tokens_per_image", 256)))
    scale = (int(vision.image_size) // int(vision.patch_size)) // int(round(tokens ** 0.5))
    if scale != 4:  # llama.cpp's default pooling for Gemma 3 (64 patches a side to 16)
        writer.add_vision_projector_scale_factor(scale)
    return notes


def transform(gguf_name: str, w: np.ndarray) -> np.ndarray:
    """Hugging Face's values -> clip's: Gemma's (1 + w) soft-embedding norm (clip multiplies by w)."""
    return w + 1.0 if "soft_emb_norm" in gguf_name else w


def _encode(gguf_name: str, w: np.ndarray) -> np.ndarray:
    if w.ndim <= 1 or gguf_name.startswith(("v.patch_embd", "v.position_embd")):
        return w.astype(np.float32)
    return w.astype(np.float16)


def write_mmproj(path: Path, model_dir: Path, config: Any) -> list[str]:
    """Write the projector file of the image-text checkpoint in `model_dir`; returns notes."""
    logging.getLogger("gguf").setLevel(logging.WARNING)
    checkpoint = CheckpointTensors(model_dir)
    name_map = gguf.TensorNameMap(gguf.MODEL_ARCH.MMPROJ, int(config.vision_config.num_hidden_layers))
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    try:
        notes = _metadata(writer, config, model_dir)
        for name in checkpoint.names():
            mapped = _vision_name(name)
            if mapped is None:
                continue
            gguf_name = name_map.get_name(mapped, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise ValueError(f"no projector-file name for tensor {name} of {model_dir}")
            writer.add_tensor(gguf_name, _encode(gguf_name, transform(gguf_name, checkpoint.get(name).float().numpy())))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return notes
