"""The vision projectors Kestrel writes for llama.cpp, one table row per image-text family.

Each row is what llama.cpp's `convert_hf_to_gguf.py --mmproj` writes for that family (read in
`conversion/gemma.py`, `conversion/qwen3vl.py`, `conversion/llava.py` of llama.cpp as vendored by
llama-cpp-python 0.3.36) and what its loader (`tools/mtmd/clip.cpp`, `models/<projector>.cpp`)
reads: the projector type and its key, which checkpoint tensors go in and under which names, the
transforms of their values, the image mean/std, the pooling key; plus how Hugging Face's vision tower takes the check's image.

- Gemma 3 (`gemma3`): SigLIP tower + soft-embedding norm + input projection. The norm scales by
  (1 + w): 1 is added. SigLIP's pooling head is unused and left out. Pooling: 4 unless
  `clip.vision.projector.scale_factor` says otherwise. Image mean/std from preprocessor_config.json.
- Gemma 4 (`gemma4v`, key `clip.vision.projector_type`): patch embedder as a linear layer over
  (row, col, channel)-flattened patches, reshaped to the (n_embd, 3, p, p) convolution clip runs;
  position table (2, n_positions, n_embd) kept as is; RMS norms multiply by w (no offset); pooling
  `pooling_kernel_size` (clip's default 3); no normalisation (mean 0, std 1: the tower computes
  2 * (x - 0.5) itself). llama.cpp's converter writes no `use_gelu`, so clip would run GELU-quick;
  Hugging Face's tower runs tanh GELU, which `use_gelu` selects. The audio tower is not written.
- Qwen3.5 and Qwen3.5-MoE (`qwen3vl_merger`): the Conv3d patch embedding over 2 frames split into
  two Conv2d kernels (`v.patch_embd.weight`, `.weight.1`); the merger's norm, fc1, fc2 as
  `v.post_ln`, `mm.0`, `mm.2`; `clip.vision.spatial_merge_size`; image size = the learned position
  grid's side x patch size; eps 1e-6 (the tower's LayerNorms; the converter writes the text model's
  rms_norm_eps, 1e-6 in released checkpoints). Deepstack mergers (Qwen3-VL's) are not in Qwen3.5.
- Mistral 3 (`pixtral`, from `conversion/llava.py`): q and k rows permuted per head from Hugging
  Face's rotate-half order to ggml's interleaved pairs; the projector's norm, patch merger,
  linear_1, linear_2 as `mm.input_norm`, `mm.patch_merger`, `mm.1`, `mm.2`; the language model's
  [IMG_BREAK] embedding row as `v.token_embd.img_break` (clip puts it after each row of image
  tokens, and needs it: without that token in the tokenizer no file is written); activation from
  `hidden_act` (silu or gelu); CLIP's image mean/std; eps 1e-5.
The check encodes a square image of a size each family's clip preprocessing keeps as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch

_SIGLIP_MEAN_STD = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
_IDENTITY_MEAN_STD = ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
_SCALE = gguf.Keys.ClipVision.Projector.SCALE_FACTOR


@dataclass(frozen=True)
class Projector:
    """One family's projector file. Names are checkpoint names; `gguf name` is the file's."""

    kind: gguf.VisionProjectorType
    type_key: str  # the metadata key clip reads the projector type from
    source_name: Callable[[str], str | None]  # checkpoint name -> gguf.TensorNameMap input, None: left out
    transforms: dict[str, Callable[[np.ndarray, Any], np.ndarray]]  # gguf name ("v.blk.{bid}.x"), (w, vision) -> clip's
    f32: tuple[str, ...]  # gguf name prefixes kept F32 (besides every 1-D tensor)
    mean_std: tuple[list[float], list[float]]  # when preprocessor_config.json has none
    image_size: Callable[[Any], int]  # vision config -> `clip.vision.image_size`
    eps: Callable[[Any], float]  # vision config -> norm epsilon
    pooling: Callable[[Any, dict[str, Any]], dict[str, int]]  # (config, preprocessor) -> pooling keys to write
    check_side: Callable[[Any], int]  # config -> side of a square image clip encodes without resizing
    hf_inputs: Callable[[torch.Tensor, Any], dict[str, torch.Tensor]]  # (3, H, W) normalised -> kwargs
    suffixes: tuple[str, ...] = (".weight", ".bias")  # what gguf.TensorNameMap may strip and put back
    renames: dict[str, str] = field(default_factory=dict)  # names gguf.TensorNameMap lacks -> gguf names (no suffix)
    splits: dict[str, Callable[[np.ndarray], dict[str, np.ndarray]]] = field(default_factory=dict)  # one -> several
    activation: Callable[[Any], str] = lambda vision: "gelu"  # the tower's FFN: gelu (tanh) or silu
    # tensors from outside the tower: (checkpoint's tensors, config, model_dir) -> {gguf name: values}
    extras: Callable[[Any, Any, Path], dict[str, np.ndarray]] = lambda checkpoint, config, model_dir: {}
    # why no file can be written for this checkpoint (None: it can)
    missing: Callable[[Path], str | None] = lambda model_dir: None
    # (HF's image embeddings (n, d), HF model, model_dir) -> the rows clip outputs
    expected: Callable[[np.ndarray, Any, Path], np.ndarray] = lambda ref, model, model_dir: ref


# ---- Gemma 3


def _gemma3_name(name: str) -> str | None:
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower."):]
    if not name.startswith(("vision_tower.", "multi_modal_projector.")) or ".head." in name:
        return None
    return name.replace("_weight", ".weight")


def _gemma3_pooling(config: Any, pre: dict[str, Any]) -> dict[str, int]:
    vision = config.vision_config
    tokens = int(pre.get("image_seq_length", getattr(config, "mm_tokens_per_image", 256)))
    scale = (int(vision.image_size) // int(vision.patch_size)) // int(round(tokens ** 0.5))
    return {} if scale == 4 else {_SCALE: scale}  # clip's default for Gemma 3: 64 patches a side to 16


GEMMA3 = Projector(
    kind=gguf.VisionProjectorType.GEMMA3,
    type_key=gguf.Keys.Clip.PROJECTOR_TYPE,
    source_name=_gemma3_name,
    transforms={"mm.soft_emb_norm.weight": lambda w, vision: w + 1.0},  # Gemma's (1 + w); clip multiplies by w
    f32=("v.patch_embd", "v.position_embd"),
    mean_std=_SIGLIP_MEAN_STD,
    image_size=lambda vision: int(vision.image_size),
    eps=lambda vision: float(getattr(vision, "layer_norm_eps", 1e-6)),
    pooling=_gemma3_pooling,
    check_side=lambda config: int(config.vision_config.image_size),
    hf_inputs=lambda pixels, config: {"pixel_values": pixels[None]},
)


# ---- Gemma 4

_GEMMA4_CLIP_POOLING = 3  # clip.cpp's default n_merge for gemma4v
_GEMMA4_MIN_TOKENS = 70  # clip.cpp resizes images that pool to fewer tokens


def _gemma4_name(name: str) -> str | None:
    if not name.startswith(("model.vision_tower.", "model.embed_vision.")):
        return None  # the language model, the audio tower
    name = name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight", ".weight")
    return name + ".weight" if name.endswith(("layer_scalar", "position_embedding_table")) else name


def _gemma4_patch_conv(w: np.ndarray, vision: Any) -> np.ndarray:
    """(n_embd, p * p * 3) linear over (row, col, channel)-flattened patches -> (n_embd, 3, p, p) conv."""
    n_embd, k = w.shape
    p = int(round((k // 3) ** 0.5))
    return np.ascontiguousarray(w.reshape(n_embd, p, p, 3).transpose(0, 3, 1, 2))


def _gemma4_side(config: Any) -> int:
    """Side of the smallest square image whose pooled tokens clip takes as they are (>= 70 tokens)."""
    vision = config.vision_config
    per_side = int(np.ceil(_GEMMA4_MIN_TOKENS ** 0.5))
    return per_side * int(vision.pooling_kernel_size) * int(vision.patch_size)


def _gemma4_inputs(pixels: torch.Tensor, config: Any) -> dict[str, torch.Tensor]:
    """(3, H, W) -> patches (1, n, p * p * 3) flattened (row, col, channel), and their (x, y) positions."""
    p = int(config.vision_config.patch_size)
    c, h, w = pixels.shape
    patches = pixels.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0).reshape(1, (h // p) * (w // p), -1)
    ys, xs = torch.meshgrid(torch.arange(h // p), torch.arange(w // p), indexing="ij")
    return {"pixel_values": patches, "image_position_ids": torch.stack([xs, ys], dim=-1).reshape(1, -1, 2)}


GEMMA4 = Projector(
    kind=gguf.VisionProjectorType.GEMMA4V,
    type_key=gguf.Keys.ClipVision.PROJECTOR_TYPE,
    source_name=_gemma4_name,
    transforms={"v.patch_embd.weight": _gemma4_patch_conv},
    f32=("v.position_embd",),
    mean_std=_IDENTITY_MEAN_STD,
    image_size=lambda vision: 224,  # clip reads it but sizes Gemma 4's images dynamically
    eps=lambda vision: float(getattr(vision, "rms_norm_eps", 1e-6)),
    pooling=lambda config, pre: ({} if int(config.vision_config.pooling_kernel_size) == _GEMMA4_CLIP_POOLING
                                 else {_SCALE: int(config.vision_config.pooling_kernel_size)}),
    check_side=_gemma4_side,
    hf_inputs=_gemma4_inputs,
    suffixes=(".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min"),  # clipped linears
)


# ---- Qwen3.5 (and Qwen3.5-MoE: the same tower)


def _qwen3_5_name(name: str) -> str | None:
    return "visual." + name[len("model.visual."):] if name.startswith("model.visual.") else None


def _qwen3_5_image_size(vision: Any) -> int:
    """The learned position grid's side in pixels: clip and Hugging Face both interpolate the grid to
    an image's patch grid, an identity at this size (which the 2 x 2 merge divides: clip keeps it)."""
    return int(round(int(vision.num_position_embeddings) ** 0.5)) * int(vision.patch_size)


def _qwen3_5_conv_split(w: np.ndarray) -> dict[str, np.ndarray]:
    """(n_embd, 3, 2, p, p) Conv3d over two frames -> two (n_embd, 3, p, p) Conv2d kernels, one a frame."""
    if w.shape[2] != 2:
        raise ValueError(f"llama.cpp's qwen3vl takes a temporal patch size of 2, not {w.shape[2]}")
    return {"v.patch_embd.weight": np.ascontiguousarray(w[:, :, 0]), "v.patch_embd.weight.1": np.ascontiguousarray(w[:, :, 1])}


def _qwen3_5_inputs(pixels: torch.Tensor, config: Any) -> dict[str, torch.Tensor]:
    """(3, H, W) -> Qwen's flattened patches (n, 3 * 2 * p * p): the image twice in time, patches in
    2 x 2 merge windows, windows row-major; and the grid (1, 3) = [[1, H / p, W / p]]."""
    vision = config.vision_config
    p, m, t = int(vision.patch_size), int(vision.spatial_merge_size), int(vision.temporal_patch_size)
    c, h, w = pixels.shape
    frames = pixels[None].expand(t, c, h, w)  # (T, C, H, W)
    x = frames.reshape(1, t, c, h // p // m, m, p, w // p // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return {"pixel_values": x.reshape((h // p) * (w // p), c * t * p * p),
            "image_grid_thw": torch.tensor([[1, h // p, w // p]])}


QWEN3_5 = Projector(
    kind=gguf.VisionProjectorType.QWEN3VL,
    type_key=gguf.Keys.Clip.PROJECTOR_TYPE,
    source_name=_qwen3_5_name,
    transforms={},
    f32=("v.patch_embd", "v.position_embd"),
    mean_std=_SIGLIP_MEAN_STD,
    image_size=_qwen3_5_image_size,
    eps=lambda vision: 1e-6,  # the tower's LayerNorms are built with eps 1e-6
    pooling=lambda config, pre: {gguf.Keys.ClipVision.SPATIAL_MERGE_SIZE: int(config.vision_config.spatial_merge_size)},
    check_side=lambda config: _qwen3_5_image_size(config.vision_config),
    hf_inputs=_qwen3_5_inputs,
    renames={"visual.merger.norm": "v.post_ln", "visual.merger.linear_fc1": "mm.0", "visual.merger.linear_fc2": "mm.2"},
    splits={"v.patch_embd.weight": _qwen3_5_conv_split},
)


# ---- Mistral 3 (Pixtral tower + patch merger + LLaVA projector)

_CLIP_MEAN_STD = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])  # Pixtral's processor
_PIXTRAL_MAX_TOKENS = 1024  # clip resizes images that merge to more tokens
_IMG_BREAK = "[IMG_BREAK]"


def _mistral3_name(name: str) -> str | None:
    name = name[len("model."):] if name.startswith("model.") else name
    return name if name.startswith(("vision_tower.", "multi_modal_projector.")) else None


def _rope_interleave(w: np.ndarray, vision: Any) -> np.ndarray:
    """q/k rows per head from Hugging Face's rotate-half order (all first halves, then all second
    halves) to ggml's interleaved pairs: (n_head, 2, d / 2, ...) -> (n_head, d / 2, 2, ...)."""
    n_head = int(vision.num_attention_heads)
    return np.ascontiguousarray(w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _img_break_id(model_dir: Path) -> int | None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    found = tokenizer.convert_tokens_to_ids(_IMG_BREAK)
    return None if found is None or found == tokenizer.unk_token_id else int(found)


def _img_break_row(checkpoint: Any, config: Any, model_dir: Path) -> dict[str, np.ndarray]:
    """clip appends the language model's [IMG_BREAK] embedding after each row of image tokens."""
    name = next(n for n in checkpoint.names() if n.endswith("embed_tokens.weight"))
    row = checkpoint.get(name)[_img_break_id(model_dir)]
    return {"v.token_embd.img_break": row.float().numpy()}


def _mistral3_side(config: Any) -> int:
    merge = int(config.vision_config.patch_size) * int(config.spatial_merge_size)
    per_side = min(int(config.vision_config.image_size) // merge, int(_PIXTRAL_MAX_TOKENS ** 0.5))
    return per_side * merge


def _with_breaks(ref: np.ndarray, model: Any, model_dir: Path) -> np.ndarray:
    """HF's (rows x cols, d) image embeddings with the [IMG_BREAK] embedding after each row but the last."""
    cols = int(round(ref.shape[0] ** 0.5))  # the check's image is square
    brk = model.get_input_embeddings().weight[_img_break_id(model_dir)].detach().float().numpy()
    rows = [np.concatenate([r, brk[None]]) for r in ref.reshape(cols, cols, -1)]
    return np.concatenate(rows)[:-1]


MISTRAL3 = Projector(
    kind=gguf.VisionProjectorType.PIXTRAL,
    type_key=gguf.Keys.Clip.PROJECTOR_TYPE,
    source_name=_mistral3_name,
    transforms={"v.blk.{bid}.attn_q.weight": _rope_interleave, "v.blk.{bid}.attn_k.weight": _rope_interleave},
    f32=("v.patch_embd",),
    mean_std=_CLIP_MEAN_STD,
    image_size=lambda vision: int(vision.image_size),
    eps=lambda vision: 1e-5,  # Pixtral's RMS norms are built with eps 1e-5
    pooling=lambda config, pre: {gguf.Keys.ClipVision.SPATIAL_MERGE_SIZE: int(config.spatial_merge_size)},
    check_side=_mistral3_side,
    hf_inputs=lambda pixels, config: {"pixel_values": pixels[None], "image_sizes": torch.tensor([list(pixels.shape[1:])]),
                                      "vision_feature_layer": config.vision_feature_layer},
    activation=lambda vision: "silu" if vision.hidden_act == "silu" else "gelu",
    renames={"multi_modal_projector.linear_1": "mm.1", "multi_modal_projector.linear_2": "mm.2"},
    extras=_img_break_row,
    missing=lambda model_dir: (None if _img_break_id(model_dir) is not None else f"llama.cpp's pixtral projector "
                               f"needs the tokenizer's {_IMG_BREAK} token, which {model_dir} lacks"),
    expected=_with_breaks,
)


# image-text model_type -> its projector
PROJECTORS: dict[str, Projector] = {"gemma3": GEMMA3, "gemma4": GEMMA4, "qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5,
                                   "mistral3": MISTRAL3}
