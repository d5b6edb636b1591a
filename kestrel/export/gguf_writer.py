"""Writing a GGUF file that llama.cpp loads, streamed one tensor at a time.

    write_gguf(path, tensors, config, family, vocab, file_type="f16", on_tensor=...)

Per family (data from `kestrel.model.registry.FamilySpec`):
- names: Hugging Face names map to llama.cpp's (`blk.3.attn_q.weight`) through `gguf.TensorNameMap`
  for the family's `gguf_arch`, which also knows Gemma 3's four norms per block.
- Q/K rows (Llama, Mistral: `gguf_permute_qk`): Hugging Face rotates the two halves of each head
  (rotate_half), llama.cpp's `llama` architecture rotates adjacent pairs. Reordering the rows of
  W_q and W_k per head from [x_0..x_{d/2-1}, y_0..y_{d/2-1}] to [x_0, y_0, x_1, y_1, ...] makes
  the pair rotation compute exactly what rotate_half computed. Qwen and Gemma use llama.cpp's
  NEOX rotation, which is rotate_half: no reordering.
- norms: Gemma multiplies by (1 + w); llama.cpp by w, so `norm_offset` is added to every norm
  weight (input, post-attention, pre/post-feed-forward, final, and Q/K norms).
- tied embeddings: no `output.weight`; llama.cpp then reads `token_embd.weight` for the output.
- Llama 3.1 RoPE scaling: a `rope_freqs` tensor of per-frequency divisors.

Types: 1-D tensors (norms, biases) stay F32; matrices are F32, F16, BF16 or Q8_0 (blocks of 32
weights sharing one f16 scale; a matrix whose rows are not a multiple of 32 stays F16). Memory:
one tensor at a time (fp32 copy + its converted copy), never the model.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch

from kestrel.errors import KestrelError
from kestrel.export.experts import GGUFView
from kestrel.export.gguf_archs import layout_for
from kestrel.export.gguf_tokenizer import GGUFVocab
from kestrel.export.merge import ModelTensors
from kestrel.model.registry import FamilySpec

Q = gguf.GGMLQuantizationType
DIRECT_TYPES = {  # file type -> (matrix type, llama.cpp file type)
    "f32": (Q.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


@dataclass
class PlannedTensor:
    gguf_name: str
    hf_name: str | None  # None for tensors computed from the config (rope_freqs)
    shape: tuple[int, ...]  # numpy order: (rows, cols)
    qtype: Any  # gguf.GGMLQuantizationType
    data: np.ndarray | None = None  # a computed tensor's values (fp32)


def _arch_enum(name: str) -> Any:
    for arch, arch_name in gguf.MODEL_ARCH_NAMES.items():
        if arch_name == name:
            return arch
    raise KestrelError(f"the installed gguf package does not know the {name!r} architecture")


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """RoPE settings as transformers 5 (`rope_parameters`, maybe per layer type) or 4 writes them."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def llama3_rope_factors(config: Any) -> np.ndarray:
    """Llama 3.1's per-frequency divisors: 1 for high frequencies (wavelength under
    original_context / high_freq_factor), `factor` for low ones, and a smooth blend between."""
    rope = rope_parameters(config)
    dim = int(_head_dim(config) * getattr(config, "partial_rotary_factor", 1.0))
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _add_rope(writer: Any, config: Any, family: FamilySpec) -> list[str]:
    """RoPE keys; returns notes on settings llama.cpp cannot express exactly."""
    notes = []
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_dimension_count(int(_head_dim(config) * getattr(config, "partial_rotary_factor", 1.0)))
    kind = rope["rope_type"]
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind not in ("default", "llama3"):
        raise KestrelError(f"RoPE scaling {kind!r} cannot be written to GGUF (supported: default, linear, yarn, llama3)")
    if family.gguf_arch == "gemma3":
        local = rope_parameters(config, "sliding_attention").get("rope_theta", 10000.0)
        if float(local) != 10000.0:
            notes.append(f"llama.cpp fixes Gemma 3's local RoPE base at 10000; this model uses {local}")
    return notes


def _gemma3_metadata(writer: Any, config: Any) -> list[str]:
    """Gemma 3's sliding window; notes where llama.cpp's fixed choices differ from the config."""
    notes = []
    writer.add_sliding_window(int(config.sliding_window))
    types = getattr(config, "layer_types", None)
    layout = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(config.num_hidden_layers)]
    if types is not None and list(types) != layout:
        notes.append("llama.cpp uses Gemma 3's 5-local-1-global attention layout; this model's layer_types differ")
    if getattr(config, "final_logit_softcapping", None):  # llama.cpp applies it (tanh cap), as Hugging Face does
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    scalar = getattr(config, "query_pre_attn_scalar", None)
    expected = config.hidden_size // config.num_attention_heads if config.num_hidden_layers == 62 else _head_dim(config)
    if scalar is not None and scalar != expected:
        notes.append(f"llama.cpp scales Gemma 3 attention by 1/sqrt({expected}); this model by 1/sqrt({scalar})")
    return notes


def add_metadata(writer: Any, config: Any, family: FamilySpec, name: str, file_type: Any) -> list[str]:
    """Architecture keys llama.cpp reads for `family`; returns notes for the export's result."""
    writer.add_name(name)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    layout = layout_for(family)
    notes = layout.metadata(writer, config)
    if layout.owns_heads_and_rope:
        return notes
    if getattr(config, "intermediate_size", None):  # Qwen3.5-MoE's config has none: every MLP is the sparse block
        writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    notes += _add_rope(writer, config, family)
    if family.moe is not None:
        writer.add_expert_count(int(getattr(config, family.moe.num_experts_attr)))
        writer.add_expert_used_count(int(config.num_experts_per_tok))
        writer.add_expert_feed_forward_length(int(getattr(config, family.moe.expert_intermediate_attr)))
        if family.moe.shared_expert:
            writer.add_expert_shared_feed_forward_length(int(config.shared_expert_intermediate_size))
    if family.gguf_arch == "gemma3":
        notes += _gemma3_metadata(writer, config)
    elif family.gguf_arch == "gpt-oss":  # llama.cpp alternates sliding and full layers, sliding first
        writer.add_sliding_window(int(config.sliding_window))
        layout = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)]
        if list(getattr(config, "layer_types", layout)) != layout:
            notes.append("llama.cpp alternates gpt-oss's sliding and full layers; this model's layer_types differ")
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        notes.append(f"llama.cpp's {family.gguf_arch} attends to the whole context; this model's sliding "
                     f"window ({config.sliding_window}) matters only past that many tokens")
    return notes


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of each head from [halves] to [interleaved pairs]; works on weights (out, in) and biases (out,)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def transform(hf_name: str, w: torch.Tensor, config: Any, family: FamilySpec) -> torch.Tensor:
    """The layout change from Hugging Face to llama.cpp for one tensor (fp32 in, fp32 out);
    `hf_name` under the causal LM's names."""
    layout = layout_for(family)
    w = layout.transform(hf_name, w, config)
    if family.gguf_permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return permute_qk(w, config.num_attention_heads)
    if family.gguf_permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return permute_qk(w, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    if family.norm_offset and "norm" in hf_name and w.ndim == 1 and layout.offsets_norm(hf_name):
        return w + family.norm_offset
    return w


def _matrix_type(shape: tuple[int, ...], wanted: Any, f32: bool = False) -> Any:
    if len(shape) < 2 or f32:
        return Q.F32
    if wanted == Q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] != 0:
        return Q.F16
    return wanted


def gguf_tensors(tensors: Any, family: FamilySpec) -> Any:
    """The tensors as llama.cpp names them: a MoE's experts stacked per projection (`GGUFView`)."""
    if family.moe is None or isinstance(tensors, GGUFView):
        return tensors
    return GGUFView(tensors, family.moe)


def plan_tensors(tensors: ModelTensors, config: Any, family: FamilySpec, file_type: str) -> list[PlannedTensor]:
    """Every tensor of the GGUF file, in order, with its name, shape and type; no data read."""
    tensors = gguf_tensors(tensors, family)
    name_map = gguf.TensorNameMap(_arch_enum(family.gguf_arch), int(config.num_hidden_layers))
    layout = layout_for(family)
    f32_names = [gguf.TENSOR_NAMES[kind].split(".")[-1] for kind in layout.f32_tensors]  # "ssm_conv1d"
    wanted = DIRECT_TYPES[file_type][0]
    plan = []
    tied = bool(getattr(config, "tie_word_embeddings", False))
    untied_head = tensors.lora is not None and "lm_head.weight" in tensors.lora.touched()
    for hf_name in tensors.language_names():
        lm_name = tensors.canonical(hf_name)  # an image-text checkpoint's under the causal LM's names
        if lm_name == "lm_head.weight" and tied and not untied_head:
            continue  # the same matrix as the embedding; llama.cpp reuses token_embd
        if layout.skip(lm_name):
            continue
        gguf_name = layout.gguf_name(lm_name, name_map)
        if gguf_name is None:
            raise KestrelError(f"no GGUF name for tensor {hf_name} of a {family.model_type} model")
        shape = layout.shape(lm_name, tensors.shape(hf_name))
        f32 = any(gguf_name.split(".")[-2] == kind for kind in f32_names)
        # biases stay F32 whatever their rank (llama.cpp adds a MoE's (E, I) expert biases in F32)
        qtype = Q.F32 if hf_name.endswith(".bias") else _matrix_type(shape, wanted, f32)
        plan.append(PlannedTensor(gguf_name, hf_name, shape, qtype))
    extra = layout.extra_tensors(config)
    if rope_parameters(config)["rope_type"] == "llama3":
        extra.append((gguf.MODEL_TENSOR.ROPE_FREQS, llama3_rope_factors(config)))
    for kind, data in extra:
        plan.append(PlannedTensor(gguf.TENSOR_NAMES[kind] + ".weight", None, data.shape, Q.F32, data))
    return plan


def _encode(w: torch.Tensor, qtype: Any) -> np.ndarray:
    """`w` (fp32, any device) as the bytes GGUF stores for `qtype`; cast where `w` is, then copied."""
    if qtype == Q.F32:
        return w.cpu().numpy()
    if qtype == Q.F16:
        return w.to(torch.float16).cpu().numpy()
    if qtype == Q.BF16:
        return w.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    return gguf.quants.quantize(w.cpu().numpy(), qtype)


def _nbytes(p: PlannedTensor) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[p.qtype]
    return math.prod(p.shape) // block * type_size


def _np_dtype(qtype: Any) -> Any:
    return {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16}.get(qtype, np.uint8)


def write_gguf(path: Path, tensors: ModelTensors | None, config: Any, family: FamilySpec, vocab: GGUFVocab,
               file_type: str, name: str, on_tensor: Callable[[int, int], None] = lambda i, n: None) -> list[str]:
    """Write `path`; with `tensors=None` a vocabulary-only file (for checking the tokenizer).

    Returns notes about settings llama.cpp handles differently from Hugging Face.
    """
    logging.getLogger("gguf").setLevel(logging.WARNING)  # it logs every file it writes at INFO
    writer = gguf.GGUFWriter(path, family.gguf_arch)
    try:
        notes = add_metadata(writer, config, family, name, DIRECT_TYPES[file_type][1])
        vocab.add_to(writer)
        tensors = gguf_tensors(tensors, family) if tensors is not None else None
        plan = plan_tensors(tensors, config, family, file_type) if tensors is not None else []
        for p in plan:
            shape = p.shape if p.qtype in (Q.F32, Q.F16, Q.BF16) else gguf.quants.quant_shape_to_byte_shape(p.shape, p.qtype)
            writer.add_tensor_info(p.gguf_name, shape, np.dtype(_np_dtype(p.qtype)), _nbytes(p),
                                   raw_dtype=None if p.qtype in (Q.F32, Q.F16) else p.qtype)
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, p in enumerate(plan):
            if p.hf_name is None:
                assert p.data is not None
                w = torch.from_numpy(p.data)
            else:
                assert tensors is not None
                w = transform(tensors.canonical(p.hf_name), tensors.get(p.hf_name), config, family)
            data = _encode(w.contiguous(), p.qtype)
            del w
            writer.write_tensor_data(data)
            del data  # before the next tensor is read: one tensor in memory at a time
            on_tensor(i + 1, len(plan))
    finally:
        writer.close()
    return notes


def gguf_nbytes(tensors: ModelTensors, config: Any, family: FamilySpec, file_type: str) -> int:
    """Size of the tensor data of the GGUF file `write_gguf` would write."""
    return sum(_nbytes(p) for p in plan_tensors(tensors, config, family, file_type))
