"""bench/lora_grad_products.py's shapes: the distinct dA / dB products of a decoder layer."""

from __future__ import annotations

from bench.lora_grad_products import product_shapes
from bench.model_shapes import MODELS


def test_products_are_the_layers_distinct_gradient_shapes() -> None:
    cfg = MODELS["qwen2.5-7b"]
    shapes = product_shapes("qwen2.5-7b", 4096, 16)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (hidden // cfg["num_attention_heads"])
    assert set(shapes.values()) == {(16, 4096, hidden), (16, 4096, inter), (hidden, 4096, 16), (kv, 4096, 16),
                                    (inter, 4096, 16)}
    assert len(shapes) == len(set(shapes.values()))  # q's dB equals hidden's here: listed once
