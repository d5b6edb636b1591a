"""Tiny random models of every supported family, built from a config (no download).

Used by the built-in `demo` model, by the tests (every fast path is checked against the
unpatched Hugging Face model on these) and by smoke runs of the benchmarks.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from kestrel.model.registry import SUPPORTED, family_of

# Small but not degenerate: GQA (4 query heads, 2 KV heads), head_dim 32, two layers.
_BASE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# Qwen3.5's structure (3 linear-attention layers to 1 full): here one of each, GQA in both,
# more value heads than key heads in the gated delta rule, a quarter of head_dim rotary.
_QWEN3_5: dict[str, Any] = dict(
    hidden_act="silu",
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    tie_word_embeddings=True,
)

_PER_FAMILY: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_act="silu"),
    "mistral": dict(hidden_act="silu", sliding_window=None),
    "qwen2": dict(hidden_act="silu", tie_word_embeddings=True),
    "qwen3": dict(hidden_act="silu", tie_word_embeddings=True),
    "gemma3_text": dict(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=32,
        sliding_window=16,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    ),
    "qwen3_5_text": _QWEN3_5,
    # Gemma 4's structure: sliding and full layers with their own head sizes, per-layer input
    # embeddings, the last two layers reading the K/V of the first two, final logit softcap.
    "gemma4_text": dict(
        hidden_activation="gelu_pytorch_tanh",
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=16,
        global_head_dim=64,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=2,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    ),
    # --- mixture of experts: the real configs' structure (Qwen3-30B-A3B, gpt-oss-20b), scaled down ---
    "qwen3_moe": dict(
        hidden_act="silu", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    # Qwen3.5-MoE (Qwen3.5-35B-A3B's structure): Qwen3.5's layers, a sparse block in each with a
    # gated shared expert wider than one routed expert.
    "qwen3_5_moe_text": dict(
        _QWEN3_5, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
    ),
    "gpt_oss": dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, attention_bias=True,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0,
        max_position_embeddings=131072,  # YaRN: original 4096 x factor 32, as gpt-oss-20b
    ),
}

# Families whose attention HF runs only in eager, flash or flex (attention sinks: gpt-oss).
_EAGER_ONLY = frozenset({"gpt_oss"})


def tiny_config(model_type: str, vocab_size: int, **overrides: Any) -> PretrainedConfig:
    """A small config of `model_type` (one of `kestrel.model.registry.SUPPORTED`)."""
    if model_type not in _PER_FAMILY:
        raise ValueError(f"no tiny config for {model_type!r}; known: {', '.join(SUPPORTED)}")
    kwargs = {**_BASE, **_PER_FAMILY[model_type], "vocab_size": vocab_size, **overrides}
    if model_type == "gemma4_text":
        kwargs.setdefault("vocab_size_per_layer_input", vocab_size)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(
    model_type: str,
    vocab_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised causal LM of `model_type`, deterministic for a given seed."""
    config = tiny_config(model_type, vocab_size, **overrides)
    config._attn_implementation = "eager" if model_type in _EAGER_ONLY else attn_implementation
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Hugging Face initialises norms to their identity; random weights make the tests see them.
    centre = 1.0 - family_of(model_type).norm_offset  # (1 + w) norms are centred on w = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(centre, 0.1)
            elif model_type in _EAGER_ONLY and ("bias" in name or "sinks" in name):  # gpt-oss: HF zeroes them
                param.normal_(0.0, 0.1)
    return model.eval()
