"""bench/gated_delta.py's parts on the CPU: the shapes it offers and its inputs through one forward
and backward of HF's function (`gated_delta.forward_backward`, which the GPU run times each way with)."""

from __future__ import annotations

import inspect

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from bench.gated_delta import inputs, linear_attention_shapes
from kestrel.kernels.gated_delta import forward_backward


def test_the_bench_offers_the_linear_attention_shapes_and_runs_a_way_once() -> None:
    shapes = linear_attention_shapes()
    assert "qwen3.5-9b" in shapes and all("linear_key_head_dim" in c for c in shapes.values())
    cfg = dict(shapes["qwen3.5-9b"], linear_num_value_heads=2)  # two heads keep the CPU run short
    xs = inputs(cfg, 1, 70, device="cpu")
    out = forward_backward(inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule), *xs, torch.float32)
    assert [t.shape for t in out] == [xs[2].shape, xs[0].shape, xs[1].shape, xs[2].shape, xs[3].shape, xs[4].shape]
    assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for t in out)


def test_each_way_gets_its_own_leaves_after_a_call_in_the_inputs_own_dtype() -> None:
    """The bench runs HF's function in fp32 first, then each way in bf16 on the same inputs: the fp32
    call must not make the caller's tensors leaves (the bf16 copies would then get no gradients)."""
    cfg = dict(linear_attention_shapes()["qwen3.5-9b"], linear_num_value_heads=2)
    xs = inputs(cfg, 1, 70, device="cpu")
    reference = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    want = forward_backward(reference, *xs, torch.float32)
    got = forward_backward(reference, *xs, torch.bfloat16)
    assert not any(x.requires_grad for x in xs)
    for a, b in zip(got, want):
        assert float((a - b).norm() / b.norm()) < 0.05
