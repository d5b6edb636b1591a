"""Frozen NF4 experts in the grouped product (kernels/moe/nf4_experts.py) against the 16-bit grouped
product on the same dequantized weights (the same math, so equal) and on the original weights (NF4 error)."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels.moe import ExpertProjection, PackedExperts, moe_experts, nf4_grouped_mm
from kestrel.kernels.moe.grouped import grouped_mm

pytest.importorskip("bitsandbytes.functional")

IMPLS = ("grouped_mm", "padded")


def _stored(transposed: bool, e: int, k: int, n: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Expert weights in the family's stored layout: (E, K, N) when transposed, else (E, N, K)."""
    shape = (e, k, n) if transposed else (e, n, k)
    return (torch.randn(shape, generator=g) * 0.05).to(dtype)


def _as_read(stored: torch.Tensor, transposed: bool) -> torch.Tensor:
    return stored if transposed else stored.transpose(1, 2)  # (E, K, N)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_grouped_mm_equals_grouped_mm_on_dequantized_weights(impl: str, transposed: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 9, 1, 0])  # experts 1 and 5 get no rows
    offsets = counts.cumsum(0).to(torch.int32)
    stored = _stored(transposed, 6, 64, 48, g, dtype)
    packed = PackedExperts(stored, transposed)
    assert packed.shape == (6, 64, 48) and packed.dtype == dtype
    deq = packed.stored().clone()
    x = torch.randn(int(counts.sum()), 64, generator=g).to(dtype).requires_grad_(True)
    dy = torch.randn(x.shape[0], 48, generator=g).to(dtype)

    y = nf4_grouped_mm(x, packed, offsets, impl)
    (dx,) = torch.autograd.grad(y, x, dy)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = grouped_mm(x_ref, _as_read(deq, transposed), offsets, impl)
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, dy)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)

    # NF4 against the original weights: a per-element error under ~1/8 of its block's absmax
    # (the widest gap between NF4 levels is 0.28, so at most half of that), hence the product's.
    assert (deq.float() - stored.float()).abs().max() <= 0.15 * stored.float().abs().max()
    y_orig = grouped_mm(x.detach(), _as_read(stored, transposed), offsets, impl)
    rel = (y.detach().float() - y_orig.float()).norm() / y_orig.float().norm()
    assert rel < 0.15


def test_nf4_forward_keeps_no_dequantized_weight_for_backward() -> None:
    """Only the offsets are saved: the (E, K, N) weight is dequantized again in backward."""
    g = torch.Generator().manual_seed(1)
    packed = PackedExperts(_stored(False, 4, 64, 32, g, torch.float32), transposed=False)
    offsets = torch.tensor([2, 5, 5, 8], dtype=torch.int32)
    x = torch.randn(8, 64, generator=g, requires_grad=True)
    y = nf4_grouped_mm(x, packed, offsets)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 1 and torch.equal(saved[0], offsets)


@pytest.mark.parametrize("impl", IMPLS)
def test_moe_experts_with_lora_on_nf4_equal_dequantized_16_bit(impl: str) -> None:
    """The routed MLP with LoRA factors: output, input gradient and the factors' gradients equal the
    16-bit path run on the dequantized weights."""
    g = torch.Generator().manual_seed(2)
    e, h, inter, r, k = 4, 64, 32, 4, 2
    gu_stored, down_stored = _stored(False, e, h, 2 * inter, g, torch.float32), _stored(False, e, inter, h, g, torch.float32)
    gu_packed, down_packed = PackedExperts(gu_stored, False), PackedExperts(down_stored, False)
    gu_deq, down_deq = gu_packed.stored().clone(), down_packed.stored().clone()
    factors = [torch.randn(s, generator=g) * 0.1 for s in [(e, h, r), (e, r, 2 * inter), (e, inter, r), (e, r, h)]]
    x = torch.randn(10, h, generator=g)
    index = torch.randint(0, e, (10, k), generator=g)
    weights = torch.softmax(torch.randn(10, k, generator=g), -1)

    def run(gu_w, down_w):
        xs = x.clone().requires_grad_(True)
        fs = [f.clone().requires_grad_(True) for f in factors]
        gu = ExpertProjection(gu_w, None, fs[0], fs[1], 2.0)
        down = ExpertProjection(down_w, None, fs[2], fs[3], 2.0)
        out = moe_experts(xs, index, weights, gu, down, impl=impl)
        grads = torch.autograd.grad(out.square().sum(), [xs, *fs])
        return out, grads

    out, grads = run(gu_packed, down_packed)
    out_ref, grads_ref = run(gu_deq.transpose(1, 2), down_deq.transpose(1, 2))
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_packed_experts_take_about_a_quarter_of_bf16() -> None:
    stored = torch.randn(8, 128, 256).to(torch.bfloat16)
    packed = PackedExperts(stored, transposed=False)
    ratio = packed.nbytes / (stored.numel() * stored.element_size())
    assert 0.25 <= ratio < 0.27  # 0.5 byte + a uint8 absmax a 64-block, against 2 bytes


def test_packed_experts_refuse_a_2d_weight() -> None:
    with pytest.raises(ValueError, match="experts, rows, columns"):
        PackedExperts(torch.randn(64, 64), transposed=False)
