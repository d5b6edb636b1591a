"""The real configs of the model families `bench/matrix.py` measures (the public configs' values;
random-init weights at these shapes change neither speed nor memory)."""

from __future__ import annotations

from typing import Any

def _gemma_layers(n: int) -> list[str]:
    """Gemma 3's pattern: five sliding-window layers, then one full-attention layer."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


_LLAMA3 = dict(model_type="llama", vocab_size=128256, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
               max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
               bos_token_id=128000, eos_token_id=128001)
_QWEN2 = dict(model_type="qwen2", head_dim=128, rope_theta=1000000.0, max_position_embeddings=131072,
              rms_norm_eps=1e-6, hidden_act="silu", vocab_size=152064, tie_word_embeddings=False)
_QWEN3 = dict(model_type="qwen3", head_dim=128, num_key_value_heads=8, rope_theta=1000000.0, vocab_size=151936,
              max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu")
_GEMMA3 = dict(model_type="gemma3_text", head_dim=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
               query_pre_attn_scalar=256, sliding_window=1024, vocab_size=262208, max_position_embeddings=131072,
               rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)

MODELS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, head_dim=64, tie_word_embeddings=True),
    "llama-3.2-3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, tie_word_embeddings=True),
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(_QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
                         max_position_embeddings=32768, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN2, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4),
    "qwen2.5-14b": dict(_QWEN2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False),
    "qwen3-14b": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, tie_word_embeddings=False),
    "gemma3-1b": dict(_GEMMA3, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, sliding_window=512, vocab_size=262144,
                      max_position_embeddings=32768, layer_types=_gemma_layers(26)),
    "gemma3-4b": dict(_GEMMA3, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                      num_attention_heads=8, num_key_value_heads=4, layer_types=_gemma_layers(34)),
    "gemma3-12b": dict(_GEMMA3, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=8, layer_types=_gemma_layers(48)),
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-5,
                       sliding_window=None, hidden_act="silu", tie_word_embeddings=False),
    # --- issue 26's dense families: transformers 5.17's default configs, which its docs call the
    # "Qwen3.5-9B style" and the google/gemma-4-e2b-it configuration (Gemma 4 E4B's values were not
    # at hand offline; E2B is 5.1B parameters with its per-layer embeddings, 2.3B without).
    # Qwen3.5: 3 of 4 layers gated-delta-rule linear attention; useful FLOPs count them as full attention.
    "qwen3.5-9b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=32768,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                       rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False),
    # Gemma 4: 5 sliding layers (head_dim 256) to 1 full one (head_dim 512), per-layer input embeddings.
    "gemma4-e2b": dict(model_type="gemma4_text", vocab_size=262144, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       global_head_dim=512, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
                       sliding_window=512, max_position_embeddings=131072, rms_norm_eps=1e-6,
                       hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
}

# --- mixture of experts (issue 26, item 2): Qwen3-30B-A3B's, gpt-oss-20b's and Qwen3.5-35B-A3B's configs ---
MOE_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                          model_type="qwen3_moe"),
    "gpt-oss-20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128, attention_bias=True,
                        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                             beta_slow=1.0, original_max_position_embeddings=4096, truncate=False),
                        max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0,
                        router_aux_loss_coef=0.9, tie_word_embeddings=False),
    # Qwen3.5-35B-A3B: transformers 5.17's default Qwen3_5MoeTextConfig, which its docs call the
    # "Qwen3.5-35B-A3B style" (34.7B parameters): Qwen3.5's 3:1 linear/full attention layers, 256
    # experts (top 8) and a shared expert in every layer.
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
                            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=32768,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                            rms_norm_eps=1e-6, hidden_act="silu", router_aux_loss_coef=0.001, tie_word_embeddings=False),
}
MODELS.update(MOE_MODELS)

# --- too large for the matrix's bf16 folders (issue 28's sharded QLoRA): built as NF4 checkpoints
# (`bench.matrix_models.build_nf4_model_dir`), run by `bench/multi_gpu.py` only ---
LARGE_MODELS: dict[str, dict[str, Any]] = {
    "llama-3.1-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, tie_word_embeddings=False),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM", "gemma4_text": "Gemma4ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
