"""llama.cpp layouts that need more than a tensor rename: Qwen3.5 (`qwen35`, and `qwen35moe`) and Gemma 4 (`gemma4`).

    layout = layout_for(family)          # ArchLayout: the common case, nothing extra
    layout.metadata(writer, config)      # the architecture's own keys
    layout.gguf_name(name, name_map)     # Hugging Face name (the causal LM's) -> llama.cpp's, or None
    layout.transform(name, w, config)    # fp32 tensor in Hugging Face's layout -> llama.cpp's

Qwen3.5 (read from llama.cpp's `src/models/qwen35.cpp` and `convert_hf_to_gguf.py`):
- gated-delta-rule layers: `in_proj_qkv` -> attn_qkv, `in_proj_z` -> attn_gate, `in_proj_a` ->
  ssm_alpha, `in_proj_b` -> ssm_beta, `conv1d` (C, 1, K) -> ssm_conv1d (C, K) in F32 (ggml's
  ssm_conv reads F32 kernels), `A_log` -> ssm_a = -exp(A_log) (llama.cpp multiplies softplus(a + dt_bias)
  by it), `dt_bias` -> ssm_dt.bias, the gated norm -> ssm_norm (its weight is used as is: no +1),
  `out_proj` -> ssm_out.
- value heads: Hugging Face groups the value heads by key head and repeats each key head
  (repeat_interleave: [K0, K0, K1, K1]); ggml broadcasts by tiling ([K0, K1, K0, K1]). With more
  value than key heads every value-head axis (V rows of qkv and of the conv kernel, z rows, a/b
  rows, A_log, dt_bias, out_proj columns) is reordered from (k, r) to (r, k) so tiling pairs the
  same heads.
- full-attention layers: q_proj's (query, gate) per head and partial interleaved M-RoPE are read by
  llama.cpp as Hugging Face stores them; the M-RoPE sections go into the metadata.
- every other norm scales by (1 + w): the family's `norm_offset` is added (not to ssm_norm).
- the multi-token-prediction head (`mtp.*`) is left out: llama.cpp's trunk does not need it.

Qwen3.5-MoE (`qwen35moe`, llama.cpp's `src/models/qwen35moe.cpp`): Qwen3.5's layers above, with
Qwen3-MoE's router and stacked experts in every MLP (`kestrel.export.experts.GGUFView`, keys written
by `gguf_writer.add_metadata`) and a shared expert: `shared_expert.*_proj` -> ffn_*_shexp,
`shared_expert_gate` (1, H) -> ffn_gate_inp_shexp, kept F32 as llama.cpp's converter keeps it;
llama.cpp adds sigmoid(x W_gate) * shared_expert(x) to the experts' output, as Hugging Face does.

Gemma 4: per-layer head sizes and K/V heads (sliding vs full), K/V shared by the last
`num_kv_shared_layers` layers (llama.cpp reuses the last sliding and the last full layer before them,
as Hugging Face does when those are the last two layers before them), per-layer input embeddings,
`layer_scalar` -> layer_output_scale.weight, and proportional RoPE on full layers as a
`rope_freqs` tensor: factor 1 on the rotated pairs and 1e30 (frequency ~0) on the unrotated ones.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch

from kestrel.errors import KestrelError
from kestrel.model.registry import FamilySpec


class ArchLayout:
    """The common case: names through `gguf.TensorNameMap`, no extra keys or tensors."""

    owns_heads_and_rope = False  # True: `metadata` writes key lengths and RoPE keys itself
    f32_tensors: tuple[Any, ...] = ()  # gguf.MODEL_TENSOR kinds kept F32 whatever the file type

    def metadata(self, writer: Any, config: Any) -> list[str]:
        return []

    def skip(self, name: str) -> bool:
        return False

    def gguf_name(self, name: str, name_map: Any) -> str | None:
        return name_map.get_name(name, try_suffixes=(".weight", ".bias"))

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def transform(self, name: str, w: torch.Tensor, config: Any) -> torch.Tensor:
        return w

    def offsets_norm(self, name: str) -> bool:
        """Whether the family's (1 + w) norm offset applies to this 1-D `norm` tensor."""
        return True

    def extra_tensors(self, config: Any) -> list[tuple[Any, np.ndarray]]:
        """(gguf.MODEL_TENSOR, fp32 data) computed from the config, appended after the weights."""
        return []


def _tiled(w: torch.Tensor, dim: int, n_k: int, head: int) -> torch.Tensor:
    """Value heads along `dim` from grouped by key head (k, r, head) to tiled (r, k, head)."""
    shape = list(w.shape)
    r = shape[dim] // (n_k * head)
    w = w.reshape(*shape[:dim], n_k, r, head, *shape[dim + 1:]).transpose(dim, dim + 1)
    return w.reshape(shape)


class Qwen35Layout(ArchLayout):
    # the shared expert's gate only exists in qwen35moe
    f32_tensors = (gguf.MODEL_TENSOR.SSM_CONV1D, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP)

    def metadata(self, writer: Any, config: Any) -> list[str]:
        n_k, n_v = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        d_k, d_v = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        if d_k != d_v:  # llama.cpp sizes value heads by ssm.state_size, the key head size
            raise KestrelError(f"llama.cpp's {writer.arch} needs linear_key_head_dim == linear_value_head_dim; "
                               f"this model has {d_k} and {d_v}")
        if n_v % n_k:
            raise KestrelError(f"linear_num_value_heads ({n_v}) is not a multiple of linear_num_key_heads ({n_k})")
        writer.add_ssm_conv_kernel(int(config.linear_conv_kernel_dim))
        writer.add_ssm_state_size(d_k)
        writer.add_ssm_group_count(n_k)
        writer.add_ssm_time_step_rank(n_v)
        writer.add_ssm_inner_size(d_v * n_v)
        types = list(config.layer_types)
        # the key the pinned gguf package has no writer method for (llama.cpp reads it, `llama-arch.cpp`)
        writer.add_array(f"{writer.arch}.attention.recurrent_layers", [t == "linear_attention" for t in types])
        writer.add_full_attention_interval(int(getattr(config, "full_attention_interval", None) or 4))
        rope = getattr(config, "rope_parameters", None) or {}
        sections = list(rope.get("mrope_section") or [11, 11, 10])  # Qwen3.5's default, as llama.cpp's converter
        writer.add_rope_dimension_sections((sections + [0] * 4)[:4])
        return []

    def skip(self, name: str) -> bool:
        return name.startswith("mtp.") or ".mtp." in name

    def gguf_name(self, name: str, name_map: Any) -> str | None:
        if name.endswith(".linear_attn.dt_bias"):
            name = name[: -len("dt_bias")] + "dt_proj.bias"
        return super().gguf_name(name, name_map)

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0], shape[2]) if name.endswith("linear_attn.conv1d.weight") else shape

    def offsets_norm(self, name: str) -> bool:
        return not name.endswith("linear_attn.norm.weight")

    def transform(self, name: str, w: torch.Tensor, config: Any) -> torch.Tensor:
        if ".linear_attn." not in name:
            return w
        if name.endswith("conv1d.weight"):
            w = w.squeeze(1)
        n_k, n_v = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        if n_v != n_k:
            w = self._tile_value_heads(name, w, n_k, int(config.linear_key_head_dim), int(config.linear_value_head_dim))
        return -torch.exp(w) if name.endswith(".A_log") else w

    @staticmethod
    def _tile_value_heads(name: str, w: torch.Tensor, n_k: int, d_k: int, d_v: int) -> torch.Tensor:
        qk = 2 * n_k * d_k  # the q and k rows ahead of v in in_proj_qkv and in the conv kernel
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            return torch.cat([w[:qk], _tiled(w[qk:], 0, n_k, d_v)])
        if name.endswith("in_proj_z.weight"):
            return _tiled(w, 0, n_k, d_v)
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_bias")):
            return _tiled(w, 0, n_k, 1)
        if name.endswith("out_proj.weight"):
            return _tiled(w, 1, n_k, d_v)
        return w


class Gemma4Layout(ArchLayout):
    owns_heads_and_rope = True

    @staticmethod
    def _layers(config: Any) -> list[Any]:
        return [config.per_layer_config[i] for i in range(int(config.num_hidden_layers))]

    @staticmethod
    def _full_rope(config: Any) -> dict[str, Any]:
        return dict(config.rope_parameters.get("full_attention") or {})

    def _head_dims(self, config: Any) -> tuple[int, int]:
        """(full layers' head size, sliding layers' head size)."""
        sizes = {t: int(c.head_dim) for t, c in zip(config.layer_types, self._layers(config))}
        full = sizes.get("full_attention", sizes.get("sliding_attention"))
        return int(full), int(sizes.get("sliding_attention", full))  # type: ignore[arg-type]

    def metadata(self, writer: Any, config: Any) -> list[str]:
        if getattr(config, "enable_moe_block", False):
            raise KestrelError("GGUF export of Gemma 4 mixture-of-experts models (enable_moe_block) is not written by "
                               "Kestrel yet; export `merged` and convert it with llama.cpp's convert_hf_to_gguf.py")
        types, layers = list(config.layer_types), self._layers(config)
        shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
        first_shared = len(types) - shared
        if shared and types[first_shared - 2:first_shared] != ["sliding_attention", "full_attention"]:
            raise KestrelError("llama.cpp's gemma4 reuses the K/V of the two layers before the shared ones as "
                               f"(sliding, full); this model's are {types[first_shared - 2:first_shared]}")
        full, swa = self._head_dims(config)
        writer.add_key_length(full)
        writer.add_value_length(full)
        writer.add_key_length_swa(swa)
        writer.add_value_length_swa(swa)
        writer.add_head_count_kv([int(c.num_key_value_heads) for c in layers])
        writer.add_feed_forward_length([int(c.intermediate_size) for c in layers])
        writer.add_shared_kv_layers(shared)
        writer.add_embedding_length_per_layer_input(int(getattr(config, "hidden_size_per_layer_input", 0) or 0))
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        writer.add_sliding_window(int(config.sliding_window))
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        local = dict(config.rope_parameters.get("sliding_attention") or {})
        for kind, params in (("sliding", local), ("full", self._full_rope(config))):
            kind_ok = params.get("rope_type", "default") in ("default", "proportional")
            # a partial default RoPE on full layers would rotate other pairs than llama.cpp's rope_freqs
            partial_ok = (kind == "sliding" or params.get("rope_type") == "proportional"
                          or params.get("partial_rotary_factor", 1.0) == 1.0)
            if not (kind_ok and partial_ok) or params.get("factor", 1.0) != 1.0:
                raise KestrelError(f"Gemma 4's {kind} layers use RoPE {params}; llama.cpp's gemma4 takes default "
                                   "(sliding) and unscaled proportional (full) RoPE")
        writer.add_rope_freq_base(float(self._full_rope(config).get("rope_theta", 1e6)))
        writer.add_rope_freq_base_swa(float(local.get("rope_theta", 1e4)))
        writer.add_rope_dimension_count(full)  # rotated pairs chosen by the rope_freqs tensor
        writer.add_rope_dimension_count_swa(int(swa * float(local.get("partial_rotary_factor", 1.0))))
        return []

    def gguf_name(self, name: str, name_map: Any) -> str | None:
        found = super().gguf_name(name, name_map)
        return found + ".weight" if found is not None and name.endswith(".layer_scalar") else found

    def extra_tensors(self, config: Any) -> list[tuple[Any, np.ndarray]]:
        full, _ = self._head_dims(config)
        rope = self._full_rope(config)
        factor = float(rope.get("partial_rotary_factor", 1.0)) if rope.get("rope_type") == "proportional" else 1.0
        rotated = int(factor * full // 2)
        freqs = np.array([1.0] * rotated + [1e30] * (full // 2 - rotated), dtype=np.float32)
        return [(gguf.MODEL_TENSOR.ROPE_FREQS, freqs)]


_QWEN35 = Qwen35Layout()
_LAYOUTS: dict[str, ArchLayout] = {"qwen35": _QWEN35, "qwen35moe": _QWEN35, "gemma4": Gemma4Layout()}
_COMMON = ArchLayout()


def layout_for(family: FamilySpec) -> ArchLayout:
    """The llama.cpp layout of `family`'s GGUF architecture."""
    return _LAYOUTS.get(family.gguf_arch, _COMMON)
