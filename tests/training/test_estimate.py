"""The memory estimate: sizes read from a config, the parts that grow with each setting, and
figures in the range measured for a Llama-3.1-8B-shaped model (bench: Unsloth QLoRA 7.0 GiB,
HF+PEFT 12.8 GiB at batch 2 x 2048 with checkpointing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel.training.estimate import (
    CONTEXT_BYTES, DEFERRED_ROWS, GIB, NF4_BYTES, detect_host_memory, estimate_training_memory, host_verdict,
    meminfo_total_bytes, shape_from_config, verdict,
)
from kestrel.paths import ASSETS

LLAMA_8B = {"vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "tie_word_embeddings": False}


def test_parameter_count_of_known_models() -> None:
    assert shape_from_config(LLAMA_8B).params == pytest.approx(8.03e9, rel=0.01)
    demo = shape_from_config(json.loads((ASSETS / "demo" / "config.json").read_text()))
    assert demo.params == 3_437_568 - 295_936  # the demo's count printed by training, minus LoRA r=16


def test_llama_8b_figures_are_in_the_measured_range() -> None:
    shape = shape_from_config(LLAMA_8B)
    qlora = estimate_training_memory(shape, "qlora", 16, None, 2, 2048, "standard").total_bytes / GIB
    lora = estimate_training_memory(shape, "lora", 16, None, 2, 2048, "standard").total_bytes / GIB
    full = estimate_training_memory(shape, "full", 16, None, 2, 2048, "standard").total_bytes / GIB
    assert 7.0 <= qlora <= 12.8
    assert 16.0 <= lora <= 24.0  # 15 GiB of bf16 weights plus the rest
    assert 60.0 <= full <= 80.0  # 8 bytes a parameter
    assert estimate_training_memory(shape, "qlora", 16).trainable == 41_943_040  # r=16, all 7 linears


def test_each_setting_moves_the_estimate_the_right_way() -> None:
    shape = shape_from_config(LLAMA_8B)

    def total(**kw: object) -> int:
        base = dict(method="qlora", lora_r=16, batch_size=2, max_seq_length=2048, gradient_checkpointing="standard")
        return estimate_training_memory(shape, **{**base, **kw}).total_bytes  # type: ignore[arg-type]

    assert total(lora_r=64) > total()
    assert total(batch_size=4) > total() and total(max_seq_length=8192) > total()
    assert total(gradient_checkpointing="off") > total() > total(gradient_checkpointing="offload")
    assert total(method="grpo") > total()


def test_verdict_thresholds() -> None:
    assert verdict(7 * GIB, 10 * GIB) == "fits"
    assert verdict(9 * GIB, 10 * GIB) == "tight"
    assert verdict(11 * GIB, 10 * GIB) == "will not fit"


def test_config_without_sizes_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="lacks the sizes"):
        shape_from_config({"model_type": "llama"})


# Peak allocated GiB of Kestrel runs on an H100, the 8B shape (bench/RESULTS.md): QLoRA with
# offloaded checkpointing at 2 x 2,048 (session 14), 32,768 and 65,536 (session 9) and 409,600
# tokens (session 12); 16-bit LoRA without checkpointing at 4,096 (session 5).
MEASURED = [
    ("qlora", 2, 2048, "offload", 6.96),
    ("qlora", 1, 32_768, "offload", 10.26),
    ("qlora", 1, 65_536, "offload", 14.29),
    ("qlora", 1, 409_600, "offload", 54.33),
    ("lora", 1, 4096, "off", 29.24),
]


@pytest.mark.parametrize(("method", "batch", "seq", "checkpointing", "allocated"), MEASURED)
def test_estimate_covers_the_measured_peak_within_20_percent(method, batch, seq, checkpointing, allocated) -> None:
    """The estimate errs toward "tight": at least the measured peak plus the CUDA context, and
    at most 20% above it (the verdict's margin)."""
    est = estimate_training_memory(shape_from_config(LLAMA_8B), method, 16, None, batch, seq,
                                   checkpointing).total_bytes / GIB
    needed = allocated + CONTEXT_BYTES / GIB
    assert needed <= est <= 1.2 * needed


def test_deferred_mlp_rows_match_the_kernel() -> None:
    from kestrel.kernels.lora import mlp

    assert DEFERRED_ROWS == mlp.DEFERRED_ROWS


def test_offload_reports_the_layer_inputs_in_host_ram() -> None:
    # 32 layers x 409,600 tokens x 4096 hidden x 2 bytes: the 107 GB that a 125 GiB host had to pin
    shape = shape_from_config(LLAMA_8B)
    est = estimate_training_memory(shape, "qlora", 16, None, 1, 409_600, "offload")
    assert est.offload_host_ram == 32 * 409_600 * 4096 * 2 == 107_374_182_400
    assert est.total_bytes == est.weights + est.optimizer + est.activations + est.extra + est.overhead  # GPU only
    for mode in ("standard", "off"):
        assert estimate_training_memory(shape, "qlora", 16, None, 1, 409_600, mode).offload_host_ram == 0
    # GRPO: batch x num_generations sequences of prompt + completion tokens, as on the GPU
    grpo = estimate_training_memory(shape, "grpo", 16, None, 2, 409_600, "offload", num_generations=4,
                                    max_completion_length=256, max_prompt_length=512)
    assert grpo.offload_host_ram == 32 * (2 * 4 * 768) * 4096 * 2


def test_offload_reports_the_gate_products_it_pages_out() -> None:
    from bench.model_shapes import MODELS

    """Short rows: the MLP keeps its gate product E, and offload pages it out of `offload_gate` of
    the layers (32 x 4,096 x 14,336 x 2 bytes: 3.5 GiB beside the inputs' 1 GiB at 2 x 2,048)."""
    shape = shape_from_config(LLAMA_8B)
    inputs, gates = 32 * 4096 * 4096 * 2, 32 * 4096 * 14336 * 2
    assert estimate_training_memory(shape, "qlora", 16, None, 2, 2048, "offload").offload_host_ram == inputs + gates
    lora = estimate_training_memory(shape, "lora", 16, None, 1, 2048, "offload")  # 16-bit keeps E up to 2,048 rows
    assert lora.offload_host_ram == (inputs + gates) // 2
    half = estimate_training_memory(shape, "qlora", 16, None, 2, 2048, "offload", offload_gate=0.5)
    assert half.offload_host_ram == inputs + gates // 2
    none = estimate_training_memory(shape, "qlora", 16, None, 2, 2048, "offload", offload_gate=0.0)
    assert none.offload_host_ram == inputs
    # past the deferral point (16-bit: 2,048 rows) the MLP keeps no E, so nothing more is paged
    assert estimate_training_memory(shape, "lora", 16, None, 2, 2048, "offload").offload_host_ram == inputs
    moe = shape_from_config(MODELS["qwen3-30b-a3b"])  # sparse blocks: experts' products, no E kept
    assert estimate_training_memory(moe, "qlora", 16, None, 2, 2048, "offload").offload_host_ram == 48 * 4096 * 2048 * 2


def test_host_verdict_uses_the_gpu_thresholds() -> None:
    est = estimate_training_memory(shape_from_config(LLAMA_8B), "qlora", 16, None, 1, 409_600, "offload")
    assert host_verdict(est, 200 * GIB) == "fits"
    assert host_verdict(est, 125 * GIB) == "tight"  # 100 GiB of 125: the host of the measured run
    assert host_verdict(est, 64 * GIB) == "will not fit"
    assert host_verdict(est, None) is None
    standard = estimate_training_memory(shape_from_config(LLAMA_8B), "qlora", 16, None, 1, 409_600, "standard")
    assert host_verdict(standard, 64 * GIB) is None


def test_meminfo_parser(tmp_path: Path) -> None:
    sample = "MemTotal:       131072000 kB\nMemFree:         1024000 kB\nMemAvailable:   98304000 kB\n"
    assert meminfo_total_bytes(sample) == 131_072_000 * 1024
    assert meminfo_total_bytes("MemFree: 1024 kB\n") is None
    path = tmp_path / "meminfo"
    path.write_text(sample)
    assert detect_host_memory(str(path)) == 131_072_000 * 1024
    assert detect_host_memory(str(tmp_path / "absent")) is None  # e.g. macOS, Windows


def test_moe_shapes_count_every_expert_and_store_experts_in_nf4_in_qlora() -> None:
    from bench.model_shapes import MODELS

    qwen, oss = shape_from_config(MODELS["qwen3-30b-a3b"]), shape_from_config(MODELS["gpt-oss-20b"])
    assert abs(qwen.params / 30.53e9 - 1) < 0.02  # Qwen3-30B-A3B: 30.5B parameters, 3.3B active
    assert abs(oss.params / 20.91e9 - 1) < 0.02  # gpt-oss-20b: 20.9B
    lora = estimate_training_memory(qwen, "lora", 16, None, 1, 2048, "standard")
    qlora = estimate_training_memory(qwen, "qlora", 16, None, 1, 2048, "standard")
    # QLoRA: attention and experts in NF4, routers, norms and embeddings 16-bit, one layer's gate_up dequantized
    nf4 = qwen.block_linear_params + qwen.expert_weight_params
    workspace = 2 * 128 * 2 * 768 * 2048
    assert qlora.weights == int(nf4 * NF4_BYTES) + 2 * (qwen.params - nf4) + workspace
    assert 15e9 < qlora.weights < 19e9  # about 61 GB of weights in bf16
    assert lora.weights > 3 * qlora.weights
    assert lora.trainable == qwen.layers * (16 * sum(a + b for a, b in qwen.linear_shapes.values())) \
        + qwen.expert_lora_params(16)
    attention_only = estimate_training_memory(qwen, "lora", 16, ["q_proj", "v_proj"], 1, 2048, "standard")
    assert attention_only.trainable < lora.trainable / 10


@pytest.mark.parametrize("model_type,rel", [("qwen3_5_text", 0.001), ("gemma4_text", 0.001)])
def test_parameter_count_of_the_issue_26_dense_families(model_type: str, rel: float) -> None:
    """Qwen3.5's linear-attention projections and gated q_proj, Gemma 4's per-layer embeddings and
    wider full-attention heads (per_layer_config): the count of a model built on the meta device
    from transformers' default config (Qwen3.5 9B, Gemma 4 E2B)."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[model_type]()
    with torch.device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert shape_from_config(json.loads(config.to_json_string())).params == pytest.approx(real, rel=rel)


def test_linear_attention_layers_hold_a_state_not_a_kv_cache() -> None:
    """GRPO rollouts of a Qwen3.5 shape: K/V only for the full-attention quarter of the layers,
    plus a fixed-size recurrent state per sequence, whatever the rollout length."""
    from transformers import CONFIG_MAPPING

    config = json.loads(CONFIG_MAPPING["qwen3_5_text"]().to_json_string())
    hybrid = shape_from_config(config)
    assert hybrid.linear_attention is not None and hybrid.attention_layers == hybrid.layers // 4
    dense = shape_from_config({k: v for k, v in config.items() if k != "layer_types"})
    short, long = (estimate_training_memory(hybrid, "grpo", max_completion_length=n).extra for n in (256, 1024))
    dense_growth = (estimate_training_memory(dense, "grpo", max_completion_length=1024).extra
                    - estimate_training_memory(dense, "grpo", max_completion_length=256).extra)
    assert long - short == pytest.approx(dense_growth / 4, rel=0.01)
    lora = estimate_training_memory(hybrid, "lora", 16, ["in_proj_qkv", "out_proj"])
    assert lora.trainable == 16 * hybrid.linear_attention.layers * sum(
        a + b for name, (a, b) in hybrid.linear_shapes.items() if name in ("in_proj_qkv", "out_proj"))


def test_a_uniform_model_is_its_layers_and_its_root() -> None:
    """The largest layer of a model whose layers are all alike is one layer's share."""
    shape = shape_from_config(LLAMA_8B)
    assert shape.largest_layer_params == 218_112_000  # 42.0M attention + 176.2M MLP + 2 norms
    assert shape.layers * shape.largest_layer_params + shape.root_params == shape.params


def test_a_full_fine_tune_on_several_gpus_is_sharded() -> None:
    """FSDP2 divides a full fine-tune's weights, gradients and moments by the GPU count; each GPU
    adds the gathered root and two layers (and their unsharded gradients); activations are each
    GPU's own batch. The 8B full fine-tune is tight on one 80 GB card and fits on four."""
    shape = shape_from_config(LLAMA_8B)
    one = estimate_training_memory(shape, "full", 16, None, 2, 2048, "standard")
    four = estimate_training_memory(shape, "full", 16, None, 2, 2048, "standard", devices=4)
    assert four.devices == 4 and one.communication == 0
    assert four.weights == one.weights // 4 and four.optimizer == one.optimizer // 4
    assert four.activations == one.activations and four.extra == one.extra
    assert four.communication == 4 * shape.root_params + 6 * shape.largest_layer_params
    h100 = 81_559 * 2**20
    assert verdict(one.total_bytes, h100) != "fits" and verdict(four.total_bytes, h100) == "fits"
    assert 0.25 < four.total_bytes / one.total_bytes < 0.45


def test_lora_on_several_gpus_keeps_the_base_on_each() -> None:
    """LoRA and QLoRA replicate the base: the same per GPU as on one, plus the flat fp32 buffer the
    adapter gradients are summed through."""
    shape = shape_from_config(LLAMA_8B)
    for method in ("lora", "qlora"):
        one = estimate_training_memory(shape, method, 16, None, 2, 2048, "standard")
        two = estimate_training_memory(shape, method, 16, None, 2, 2048, "standard", devices=2)
        assert (two.weights, two.optimizer, two.activations) == (one.weights, one.optimizer, one.activations)
        assert two.communication == 4 * one.trainable


def test_qwen3_5_moe_counts_experts_the_shared_expert_and_linear_attention() -> None:
    """The Qwen3.5-35B-A3B shape: the parameter count of the model built on the meta device (every
    expert, the shared expert and its gate, linear attention's projections) and of its largest
    layer (which FSDP2 gathers whole); the shared expert's linears take LoRA and NF4 like a dense
    MLP's; GRPO rollouts keep K/V for the full-attention quarter of the layers and a recurrent
    state for the rest."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.model_shapes import MODELS

    cfg = dict(MODELS["qwen3.5-35b-a3b"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    shape = shape_from_config({"model_type": "qwen3_5_moe", "text_config": MODELS["qwen3.5-35b-a3b"],
                               "vision_config": {"depth": 27}})  # as the image-text checkpoint nests it
    assert abs(real / 34.66e9 - 1) < 0.01 and shape.params == pytest.approx(real, rel=1e-4)
    assert (shape.attention_layers, shape.linear_attention.layers) == (10, 30)
    # What FSDP2 gathers at once: the experts, the shared expert and the gates (the estimate leaves
    # out linear attention's convolution and decay parameters, 33k of 843M).
    assert shape.largest_layer_params == pytest.approx(largest, rel=1e-4)
    assert shape.active_intermediate == 8 * 512 + 512  # k routed experts and the shared one
    shared = {"gate_proj": (2048, 512), "up_proj": (2048, 512), "down_proj": (512, 2048)}
    assert {name: shape.linear_shapes[name] for name in shared} == shared
    lora = estimate_training_memory(shape, "lora", 16, ["gate_proj", "up_proj", "down_proj"], 1, 2048)
    assert lora.trainable == shape.layers * 16 * sum(a + b for a, b in shared.values()) + shape.expert_lora_params(16)
    qlora = estimate_training_memory(shape, "qlora", 16, None, 1, 2048)
    nf4 = shape.block_linear_params + 40 * 256 * 3 * 2048 * 512  # linears and every layer's experts
    workspace = 2 * 256 * 2 * 512 * 2048  # one layer's gate_up dequantized to 16-bit
    assert qlora.weights == int(nf4 * 0.54) + 2 * (shape.params - nf4) + workspace
    grpo = estimate_training_memory(shape, "grpo", 16, None, 1, 2048, num_generations=4,
                                    max_prompt_length=512, max_completion_length=256)
    kv = 2 * 10 * 4 * 768 * 2 * 256 * 2  # K and V, 10 layers, 4 sequences of 768 tokens, 2 KV heads of 256
    assert grpo.extra == 1024 * 248320 * 4 + kv + 4 * shape.linear_attention.state_bytes()  # + a logits chunk


def test_kept_attention_outputs_are_paged_too() -> None:
    # 32 attention layers x 4,096 tokens x 32 heads x (128 x 2 + 4) bytes: the outputs and logsumexps
    shape = shape_from_config(LLAMA_8B)
    plain = estimate_training_memory(shape, "qlora", 16, None, 2, 2048, "offload")
    kept = estimate_training_memory(shape, "qlora", 16, None, 2, 2048, "offload", keep_attention="on",
                                    keep_projection="off", keep_qkv="off")
    assert kept.offload_host_ram - plain.offload_host_ram == 32 * 4096 * 32 * (128 * 2 + 4)
    assert kept.total_bytes == plain.total_bytes  # host memory only
    projection = estimate_training_memory(shape, "qlora", 16, None, 2, 2048, "offload", keep_attention="on",
                                          keep_projection="on", keep_qkv="off")
    assert projection.offload_host_ram - kept.offload_host_ram == 32 * 4096 * 4096 * 2  # o_proj's outputs
    qkv = estimate_training_memory(shape, "qlora", 16, None, 2, 2048, "offload", keep_attention="on",
                                   keep_projection="on", keep_qkv="on")
    assert qkv.offload_host_ram - projection.offload_host_ram == 32 * 4096 * (32 + 2 * 8) * 128 * 2  # Q, K, V
    standard = estimate_training_memory(shape, "qlora", 16, None, 2, 2048, "standard", keep_attention="on")
    assert standard.offload_host_ram == 0
    # Qwen3.5: the full-attention quarter of the layers keeps them, Q with each head's output gate
    from transformers import CONFIG_MAPPING

    hybrid = shape_from_config(json.loads(CONFIG_MAPPING["qwen3_5_text"]().to_json_string()))
    assert hybrid.attn_output_gate
    args = (hybrid, "qlora", 16, None, 2, 2048, "offload")
    held = [estimate_training_memory(*args, keep_attention="on", keep_projection="on", keep_qkv=qkv).offload_host_ram
            for qkv in ("off", "on")]
    (n, head_dim, kv), = hybrid.attention_kinds()
    assert n == hybrid.layers // 4 and held[1] - held[0] == n * 4096 * (2 * hybrid.heads + 2 * kv) * head_dim * 2
    # auto (the default) keeps them only where the host has room to spare: never counted as needed, so
    # the longest contexts still choose offloading on the host memory their inputs need
    long_off = estimate_training_memory(shape, "qlora", 16, None, 1, 409_600, "offload", keep_attention="off")
    long_auto = estimate_training_memory(shape, "qlora", 16, None, 1, 409_600, "offload", keep_attention="auto")
    assert long_auto.offload_host_ram == long_off.offload_host_ram
    assert estimate_training_memory(shape, "qlora", 16, None, 1, 409_600, "offload").offload_host_ram == long_off.offload_host_ram
