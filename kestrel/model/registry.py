"""Model families, described once as data.

Each supported family is one `FamilySpec` keyed by `config.model_type`. The generic patcher
(`kestrel.model.patching`) reads these fields and nothing else, so adding a family means adding an entry
here, not writing another patch function. Export (`kestrel.export`) reads the GGUF fields.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

# The module levels the patcher can put on Kestrel's forwards (see `kestrel.model.patching`).
Level = Literal["rms_norm", "attention", "linear_attention", "mlp", "decoder_layer", "model", "causal_lm"]
ALL_LEVELS: frozenset[str] = frozenset(("rms_norm", "attention", "mlp", "decoder_layer", "model", "causal_lm"))


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts family's sparse MLP block (router + experts with 3-D weight tensors)."""

    block_class: str  # e.g. "Qwen3MoeSparseMoeBlock"; its `experts` hold gate_up_proj and down_proj
    router_attr: str  # the block's router module: it returns (logits, top-k weights, top-k index)
    num_experts_attr: str  # config attribute holding the number of experts
    expert_intermediate_attr: str  # config attribute holding one expert's intermediate size
    activation: Literal["swiglu", "gpt_oss"] = "swiglu"  # [gate | up] halves, or gpt-oss's clamped interleave
    transposed: bool = False  # weights stored (E, in, out) (gpt-oss) rather than (E, out, in)
    bias: bool = False  # per-expert biases gate_up_proj_bias, down_proj_bias
    returns_scores: bool = False  # the block returns (hidden, router scores) rather than hidden
    # The block also holds `shared_expert` (an MLP every token runs) and `shared_expert_gate`
    # (hidden -> 1): output = experts + sigmoid(x W_gate) * shared_expert(x) (Qwen3.5-MoE).
    shared_expert: bool = False


@dataclass(frozen=True)
class FamilySpec:
    """What the patcher and the exporter need to know about one model family."""

    model_type: str
    causal_lm_class: str  # e.g. "LlamaForCausalLM"
    model_class: str  # the decoder stack, e.g. "LlamaModel"
    decoder_layer_class: str
    attention_class: str
    mlp_class: str
    norm_class: str  # every RMSNorm of the family: layer norms, final norm, QK-norms
    norm_offset: float = 0.0  # Gemma scales by (1 + w)
    norm_casting: Literal["llama", "gemma"] = "llama"  # where the cast back to 16-bit happens
    activation: Literal["swiglu", "geglu"] = "swiglu"
    qk_norm: bool = False  # RMSNorm over head_dim on Q and K before RoPE
    sandwich_norm: bool = False  # extra norms after attention and after the MLP (Gemma 3)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden) (Gemma)
    logit_softcap_attr: str | None = None  # config attribute holding the final logit softcap
    # Which layers use config.sliding_window: none, all (Mistral, when the window is set) or
    # those config.layer_types marks "sliding_attention" (Qwen2/3, Gemma 3).
    sliding_layers: Literal["none", "all", "by_layer_type"] = "none"
    rope_per_layer_type: bool = False  # separate rotary tables for sliding and full layers (Gemma 3)
    mrope: bool = False  # the rotary embedding takes (3, B, T) positions, one row an axis; text repeats its own
    attn_softcap_attr: str | None = None  # config attribute of an attention-logit softcap, if any
    # --- mixture of experts and gpt-oss's attention (issue 26, item 2) ---
    moe: MoeSpec | None = None  # the sparse MLP, for mixture-of-experts families
    attention_sinks: bool = False  # a learned per-head logit in every softmax's denominator (gpt-oss)
    rope_half_table: bool = False  # the rotary tables hold head_dim / 2 columns (gpt-oss), not head_dim
    gguf_arch: str = "llama"  # llama.cpp's architecture name
    gguf_permute_qk: bool = False  # Llama-style Q/K row permutation for llama.cpp's RoPE
    # Levels with a Kestrel forward; the others keep Hugging Face's (a family whose layers hold
    # more than attention or linear attention + MLP, e.g. Gemma 4's per-layer inputs).
    levels: frozenset[str] = ALL_LEVELS
    linear_attention_class: str | None = None  # gated-delta-rule layers (Qwen3.5), `kestrel.model.linear_attention`
    linear_attention_attr: str = "linear_attn"  # where a decoder layer holds it (in place of `self_attn`)
    # Linears beyond attention + MLP that "every linear" LoRA also covers (linear attention's projections).
    extra_lora_targets: tuple[str, ...] = ()
    attn_output_gate: bool = False  # q_proj yields (query, gate) per head; output * sigmoid(gate) (Qwen3.5)
    # A decoder-layer keyword holding tensors that some layers write and later layers read (Gemma 4's
    # shared K/V): checkpointing keeps them differentiable (`kestrel.recompute.linked`).
    layer_shared_state: str | None = None
    decode: bool = True  # Kestrel's decode forward (`kestrel.decode.model`) covers it; else HF's cached forward
    gguf: bool = True  # `kestrel.export` writes its GGUF (llama.cpp's tensor layout is mapped)


# Gemma 3's norms, activation, embeddings, head and attention layout; Gemma 4 (below) is this
# spec with its own classes and what differs.
_GEMMA3 = FamilySpec(
    model_type="gemma3_text",
    causal_lm_class="Gemma3ForCausalLM",
    model_class="Gemma3TextModel",
    decoder_layer_class="Gemma3DecoderLayer",
    attention_class="Gemma3Attention",
    mlp_class="Gemma3MLP",
    norm_class="Gemma3RMSNorm",
    norm_offset=1.0,
    norm_casting="gemma",
    activation="geglu",
    qk_norm=True,
    sandwich_norm=True,
    embed_scale=True,
    logit_softcap_attr="final_logit_softcapping",
    sliding_layers="by_layer_type",
    rope_per_layer_type=True,
    attn_softcap_attr="attn_logit_softcapping",
    gguf_arch="gemma3",
)

# --- families added for issue 26 (dense; Gemma 4 on part of the fast path) -------------------
# Qwen3.5: 3 of 4 layers gated-delta-rule linear attention (flash-linear-attention's
# kernels on CUDA, HF's reference elsewhere), the others gated full attention
# with partial RoPE; zero-centred (1 + w) norms cast after the scale. Qwen3.5-MoE (below) is
# this spec with its own classes and a sparse MLP.
_QWEN3_5 = FamilySpec(
    model_type="qwen3_5_text",
    causal_lm_class="Qwen3_5ForCausalLM",
    model_class="Qwen3_5TextModel",
    decoder_layer_class="Qwen3_5DecoderLayer",
    attention_class="Qwen3_5Attention",
    mlp_class="Qwen3_5MLP",
    norm_class="Qwen3_5RMSNorm",
    norm_offset=1.0,
    norm_casting="gemma",
    qk_norm=True,
    attn_output_gate=True,
    linear_attention_class="Qwen3_5GatedDeltaNet",
    extra_lora_targets=("in_proj_qkv", "in_proj_z", "out_proj"),
    mrope=True,
    levels=ALL_LEVELS | {"linear_attention"},
    decode=False,
    gguf_arch="qwen35",
)

# Gemma 4: per-layer input embeddings, K/V shared across the last layers, a value norm and
# per-layer-type head sizes live in HF's decoder layer and attention; norms (w, cast after
# the scale), the GeGLU MLP and the softcapped head run here.
_GEMMA4 = replace(
    _GEMMA3,
    model_type="gemma4_text",
    causal_lm_class="Gemma4ForCausalLM",
    model_class="Gemma4TextModel",
    decoder_layer_class="Gemma4TextDecoderLayer",
    attention_class="Gemma4TextAttention",
    mlp_class="Gemma4TextMLP",
    norm_class="Gemma4RMSNorm",
    norm_offset=0.0,
    attn_softcap_attr=None,
    levels=frozenset(("rms_norm", "mlp", "causal_lm")),
    layer_shared_state="shared_kv_states",
    decode=False,
    gguf_arch="gemma4",
)
# --- end of issue 26 dense families -----------------------------------------------------------

FAMILIES: dict[str, FamilySpec] = {
    spec.model_type: spec
    for spec in (
        FamilySpec(
            model_type="llama",
            causal_lm_class="LlamaForCausalLM",
            model_class="LlamaModel",
            decoder_layer_class="LlamaDecoderLayer",
            attention_class="LlamaAttention",
            mlp_class="LlamaMLP",
            norm_class="LlamaRMSNorm",
            gguf_arch="llama",
            gguf_permute_qk=True,
        ),
        FamilySpec(
            model_type="mistral",
            causal_lm_class="MistralForCausalLM",
            model_class="MistralModel",
            decoder_layer_class="MistralDecoderLayer",
            attention_class="MistralAttention",
            mlp_class="MistralMLP",
            norm_class="MistralRMSNorm",
            sliding_layers="all",
            gguf_arch="llama",
            gguf_permute_qk=True,
        ),
        FamilySpec(
            model_type="qwen2",
            causal_lm_class="Qwen2ForCausalLM",
            model_class="Qwen2Model",
            decoder_layer_class="Qwen2DecoderLayer",
            attention_class="Qwen2Attention",
            mlp_class="Qwen2MLP",
            norm_class="Qwen2RMSNorm",
            sliding_layers="by_layer_type",
            gguf_arch="qwen2",
        ),
        FamilySpec(
            model_type="qwen3",
            causal_lm_class="Qwen3ForCausalLM",
            model_class="Qwen3Model",
            decoder_layer_class="Qwen3DecoderLayer",
            attention_class="Qwen3Attention",
            mlp_class="Qwen3MLP",
            norm_class="Qwen3RMSNorm",
            sliding_layers="by_layer_type",
            qk_norm=True,
            gguf_arch="qwen3",
        ),
        _GEMMA3,
        _QWEN3_5,
        _GEMMA4,
    )
}

# --- Mixture-of-experts families (issue 26, item 2) ----------------------------------------
# Qwen3-MoE and gpt-oss decode on Kestrel's decode forward (its sparse block: `kestrel.decode.moe`;
# gpt-oss's sinks in the decode attention kernel). Qwen3.5-MoE decodes through HF's forward
# (`kestrel.decode.hf_backend`), as Qwen3.5 does: the decode forward has no linear-attention
# layers (a recurrent state per row, not a K/V cache). The GGUF of all three maps the 3-D expert
# tensors (`kestrel.export.experts`).
# Qwen3-MoE's router and experts; Qwen3.5-MoE's block adds a gated shared expert.
_QWEN3_MOE_BLOCK = MoeSpec(
    block_class="Qwen3MoeSparseMoeBlock",
    router_attr="gate",
    num_experts_attr="num_experts",
    expert_intermediate_attr="moe_intermediate_size",
)
_MOE_FAMILIES = (
    FamilySpec(
        model_type="qwen3_moe",
        causal_lm_class="Qwen3MoeForCausalLM",
        model_class="Qwen3MoeModel",
        decoder_layer_class="Qwen3MoeDecoderLayer",
        attention_class="Qwen3MoeAttention",
        mlp_class="Qwen3MoeMLP",  # the dense MLP of `mlp_only_layers`
        norm_class="Qwen3MoeRMSNorm",
        qk_norm=True,
        sliding_layers="all",  # config.sliding_window is None unless use_sliding_window
        moe=_QWEN3_MOE_BLOCK,
        gguf_arch="qwen3moe",
    ),
    FamilySpec(
        model_type="gpt_oss",
        causal_lm_class="GptOssForCausalLM",
        model_class="GptOssModel",
        decoder_layer_class="GptOssDecoderLayer",
        attention_class="GptOssAttention",
        mlp_class="GptOssMLP",  # every layer's MLP is the sparse block
        norm_class="GptOssRMSNorm",
        norm_casting="gemma",  # (w * normed).to(dtype), fp32 weights; offset 0
        sliding_layers="by_layer_type",
        moe=MoeSpec(
            block_class="GptOssMLP",
            router_attr="router",
            num_experts_attr="num_local_experts",
            expert_intermediate_attr="intermediate_size",
            activation="gpt_oss",
            transposed=True,
            bias=True,
            returns_scores=True,
        ),
        attention_sinks=True,
        rope_half_table=True,
        gguf_arch="gpt-oss",
    ),
    # Qwen3.5-MoE: Qwen3.5's layers (linear and gated full attention, on the same forwards) with
    # Qwen3-MoE's router and experts in every layer's MLP, plus a shared expert behind a sigmoid
    # gate (its MLP, `mlp_class`, on the dense MLP forward).
    replace(
        _QWEN3_5,
        model_type="qwen3_5_moe_text",
        causal_lm_class="Qwen3_5MoeForCausalLM",
        model_class="Qwen3_5MoeTextModel",
        decoder_layer_class="Qwen3_5MoeDecoderLayer",
        attention_class="Qwen3_5MoeAttention",
        mlp_class="Qwen3_5MoeMLP",  # the shared expert
        norm_class="Qwen3_5MoeRMSNorm",
        linear_attention_class="Qwen3_5MoeGatedDeltaNet",
        moe=replace(_QWEN3_MOE_BLOCK, block_class="Qwen3_5MoeSparseMoeBlock", shared_expert=True),
        gguf_arch="qwen35moe",  # Qwen3.5's layout with Qwen3-MoE's experts and a shared expert
    ),
)
FAMILIES.update({spec.model_type: spec for spec in _MOE_FAMILIES})

SUPPORTED = tuple(FAMILIES)  # every family the patcher knows (some on part of the fast path)
DECODE_FAMILIES = tuple(t for t, s in FAMILIES.items() if s.decode)  # Kestrel's own decode forward
GGUF_FAMILIES = tuple(t for t, s in FAMILIES.items() if s.gguf)  # GGUF export
# The whole stack on Kestrel's forwards (varlen packing, in-place residuals, offloaded checkpoints).
FULL_PATH_FAMILIES = tuple(t for t, s in FAMILIES.items() if ALL_LEVELS <= s.levels)


def family_of(model_type: str) -> FamilySpec | None:
    """The family registered for `config.model_type`, or None for an unknown family."""
    return FAMILIES.get(model_type)


def _field(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def text_config(config: Any) -> Any:
    """The language model's config (a config object or a config.json dict): `config` itself, or
    an image-text model's `text_config`."""
    inner = _field(config, "text_config")
    return inner if inner is not None and _field(config, "vision_config") is not None else config


def is_image_text(config: Any) -> bool:
    """True for the config (object or config.json dict) of an image-text checkpoint (one with a vision tower)."""
    return text_config(config) is not config


def family_for(config: Any) -> FamilySpec | None:
    """The family of a model's language model (config object or config.json dict):
    `model_type`, else (an image-text checkpoint such as Gemma 3 4B, Qwen3.5 or Mistral 3) its
    `text_config`'s."""
    return family_of(_field(config, "model_type") or "") or family_of(_field(text_config(config), "model_type") or "")


def logit_softcap(config: Any) -> float | None:
    """The final logit cap of a model's language model (config object or config.json dict; an image-text
    model's `text_config` holds it): its family's `logit_softcap_attr`, HF's `final_logit_softcapping` for a
    family Kestrel does not know, None where there is none. Logits are then softcap * tanh(logits / softcap)."""
    spec = family_for(config)
    attr = "final_logit_softcapping" if spec is None else spec.logit_softcap_attr
    value = _field(text_config(config), attr) if attr else None
    return float(value) if value else None


def hf_attention(config: Any, asked: str = "sdpa") -> str:
    """The attention implementation to ask Hugging Face for: `asked`, except eager in place of SDPA
    for a family with attention sinks (HF runs sinks in eager, flash or flex attention, not SDPA)."""
    spec = family_for(config)
    return "eager" if asked == "sdpa" and spec is not None and spec.attention_sinks else asked
