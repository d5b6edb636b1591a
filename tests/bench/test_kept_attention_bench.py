"""bench/kept_attention.py's two ways give the same output and gradients (on the CPU, reference kernels)."""

from __future__ import annotations

import torch

from bench.kept_attention import heads, inputs, passes, relative_error
from bench.model_shapes import MODELS
from kestrel.model.kept_attention import REFERENCE_CAUSAL


def test_both_ways_give_the_same_output_and_gradients() -> None:
    hq, hkv, d = heads(MODELS["qwen3-4b"])
    assert (hq, hkv, d) == (32, 8, 128)
    q, k, v, grad = inputs(1, 24, 4, 2, 8, device="cpu", dtype=torch.float64)
    ways = passes(q, k, v, grad, 8 ** -0.5, REFERENCE_CAUSAL)
    want, got = ways["recomputed"](), ways["kept"]()
    assert all(relative_error(a, b) < 1e-10 for a, b in zip(got, want))
