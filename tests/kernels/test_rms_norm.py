"""rms_norm against Hugging Face's LlamaRMSNorm and Gemma3RMSNorm: forward, dx and dweight,
through the Triton kernels (the CPU interpreter here, CUDA on the GPU machine) and the torch
reference."""

from __future__ import annotations

import os

import pytest
import torch
import triton
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kestrel.kernels._utils import as_rows, cdiv, next_pow2, round_up_coarse, row_stride
from kestrel.kernels.rms_norm import rms_norm, rms_norm_reference
from tests.kernels.tolerance import assert_close

# Small tests run where the Triton kernels can: CUDA when compiled, the CPU under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# Narrow rows go many to a tile (hidden 96: 32 rows); hidden 4100 is one row a tile (BLOCK 8192).
SHAPES = [(3, 37, 96), (2, 5, 123), (1, 1, 64), (2, 3, 4100)]
EPS = 1e-6


def _hf_module(casting: str, hidden: int, dtype: torch.dtype, device: str = DEVICE) -> torch.nn.Module:
    module = LlamaRMSNorm(hidden, eps=EPS) if casting == "llama" else Gemma3RMSNorm(hidden, eps=EPS)
    with torch.no_grad():
        # Llama weights sit near 1, Gemma3's near 0 (it adds the 1 itself).
        centre = 1.0 if casting == "llama" else 0.0
        module.weight.copy_(centre + 0.3 * torch.randn(hidden))
    return module.to(device=device, dtype=dtype)


def _forward_backward(fn, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    y = fn(x, weight)
    dx, dw = torch.autograd.grad(y, (x, weight), grad)
    return y, dx, dw


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
def test_matches_hf_and_reference(backend, poisoned, shape, dtype, casting, offset) -> None:
    torch.manual_seed(0)
    hidden = shape[-1]
    hf = _hf_module(casting, hidden, dtype)
    x = (2.0 * torch.randn(shape, device=DEVICE)).to(dtype)
    grad = torch.randn(shape, device=DEVICE).to(dtype)

    def hf_fn(x, w):
        return torch.func.functional_call(hf, {"weight": w}, (x,))

    ours = _forward_backward(lambda x, w: rms_norm(x, w, EPS, offset, casting), x, hf.weight, grad)
    ref = _forward_backward(
        lambda x, w: rms_norm_reference(x, w, EPS, offset, casting), x, hf.weight, grad
    )
    expected = _forward_backward(hf_fn, x, hf.weight, grad)
    for got, want, ref_value in zip(ours, expected, ref):
        assert torch.isfinite(got).all()
        assert_close(got, want)
        assert_close(got, ref_value)


def test_llama_promotes_like_hf(backend) -> None:
    """bf16 activations with an fp32 weight give an fp32 output in HF; so must we."""
    torch.manual_seed(1)
    hf = _hf_module("llama", 64, torch.float32)
    x = torch.randn(2, 3, 64, device=DEVICE).to(torch.bfloat16)
    y = rms_norm(x, hf.weight, EPS)
    assert y.dtype == torch.float32
    assert_close(y, hf(x), tight=False)  # normed was rounded to bf16 on both sides


def test_frozen_weight_and_strided_rows(backend, poisoned) -> None:
    """LoRA case: weight without grad (no dweight pass). x is a column slice (row stride 160)."""
    torch.manual_seed(2)
    big = torch.randn(4, 7, 160, device=DEVICE, requires_grad=True)
    x = big[..., 10:106]
    weight = 1.0 + 0.1 * torch.randn(96, device=DEVICE)
    grad = torch.randn(4, 7, 96, device=DEVICE)
    y = rms_norm(x, weight, EPS)
    (dx,) = torch.autograd.grad(y, (x,), grad)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = rms_norm_reference(x_ref, weight, EPS)
    (dx_ref,) = torch.autograd.grad(y_ref, (x_ref,), grad)
    assert_close(y, y_ref)
    assert_close(dx, dx_ref)


def test_expanded_gradient(backend) -> None:
    """`.sum()` hands back a gradient with stride 0; the kernel must not read it as rows."""
    torch.manual_seed(3)
    x = torch.randn(5, 33, device=DEVICE, requires_grad=True)
    w = torch.randn(33, device=DEVICE, requires_grad=True)
    dx, dw = torch.autograd.grad(rms_norm(x, w, EPS).sum(), (x, w))
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    dx_ref, dw_ref = torch.autograd.grad(rms_norm_reference(x_ref, w_ref, EPS).sum(), (x_ref, w_ref))
    assert_close(dx, dx_ref)
    assert_close(dw, dw_ref)


@pytest.mark.parametrize("n_rows,hidden", [(1000, 64), (37, 4100)])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
def test_backward_walks_every_row(backend, poisoned, n_rows, hidden, casting, offset) -> None:
    """Backward programs that each walk several tiles, the last partly past the end (the
    interpreter counts 4 SMs: 8 programs of 2 tiles of 64 rows, or 4 programs of 10 rows)."""
    torch.manual_seed(5)
    x = torch.randn(n_rows, hidden, device=DEVICE)
    w = (1.0 - offset) + 0.3 * torch.randn(hidden, device=DEVICE)
    grad = torch.randn(n_rows, hidden, device=DEVICE)
    ours = _forward_backward(lambda x, w: rms_norm(x, w, EPS, offset, casting), x, w, grad)
    ref = _forward_backward(lambda x, w: rms_norm_reference(x, w, EPS, offset, casting), x, w, grad)
    for got, want in zip(ours, ref):
        assert torch.isfinite(got).all()
        assert_close(got, want)


def testround_up_coarse() -> None:
    """Trip counts: never below n, at most 25% above, few distinct values."""
    values = [round_up_coarse(n) for n in range(1, 4097)]
    assert all(n <= v <= max(n, 1.25 * n) for n, v in zip(range(1, 4097), values))
    assert len(set(values)) <= 8 + 4 * 12  # 1..8, then four values per octave up to 4096


def test_plans_follow_shape_and_strides(backend, poisoned) -> None:
    """Launch parameters are cached per shape, strides and dtypes: one shape as contiguous rows,
    as rows of stride 160 (a column slice) and as a transposed view (copied to rows), with a
    dense and then an expanded gradient, and a new row count, back to back, against the reference."""
    torch.manual_seed(6)
    big = torch.randn(4, 7, 160, device=DEVICE)
    w = 1.0 + 0.1 * torch.randn(96, device=DEVICE)
    dense = big[..., :96].contiguous()
    transposed = dense.transpose(0, 1).contiguous().transpose(0, 1)  # rows that do not merge
    layouts = [dense, big[..., 10:106], transposed, big[:3, ..., :96].contiguous(), dense]
    for x in layouts:
        for loss in (lambda y: (y * y).sum(), lambda y: y.sum()):  # dense, then stride-0 gradient
            got = _forward_backward(lambda x, w: loss(rms_norm(x, w, EPS)), x, w, torch.ones(()))
            want = _forward_backward(lambda x, w: loss(rms_norm_reference(x, w, EPS)), x, w, torch.ones(()))
            for g, expected in zip(got, want):
                assert_close(g, expected)


def test_row_stride_matches_as_rows() -> None:
    """`row_stride` (cached, from shape and strides) is None exactly where `as_rows` copies, and
    otherwise the row stride of its view."""
    base = torch.zeros(6, 4, 10)
    cases = [base, base[..., :8], base[:, 1:3, 2:9], base.transpose(0, 1), base[:, :1], base[:1, :1],
             base[:, :, :1], base[::2], base[:, ::2, :8], base.permute(2, 0, 1), base[0, 0],
             torch.zeros(1, 10).expand(5, 10), torch.zeros(3, 1, 10).expand(3, 4, 10), base[:0],
             torch.zeros(200).as_strided((4, 1, 3, 8), (48, 1000, 16, 1)), base.view(-1)[::2]]
    for t in cases:
        rows = as_rows(t)
        viewed = rows.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        got = row_stride(t.shape, t.stride())
        assert (got is not None) == (viewed and t.numel() > 0), (t.shape, t.stride())
        if got is not None and rows.shape[0] > 1:
            assert got == rows.stride(0), (t.shape, t.stride())


def test_integer_helpers_match_triton() -> None:
    assert all(next_pow2(n) == triton.next_power_of_2(n) for n in range(0, 5000))
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 300) for b in range(1, 40))


def test_rejects_bad_arguments() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="casting"):
        rms_norm(x, torch.ones(8), EPS, casting="t5")
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(x, torch.ones(9), EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("shape,dtype", [((2, 2048, 4096), torch.bfloat16), ((1, 999, 8192), torch.float32)])
def test_large_cuda(monkeypatch, casting, offset, shape, dtype) -> None:
    """LLM shapes on CUDA: many backward programs, each accumulating dweight over many rows."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    torch.manual_seed(4)
    hf = _hf_module(casting, shape[-1], dtype, "cuda")
    x = torch.randn(shape, device="cuda").to(dtype)
    grad = torch.randn(shape, device="cuda").to(dtype)
    ours = _forward_backward(lambda x, w: rms_norm(x, w, EPS, offset, casting), x, hf.weight, grad)

    def hf_fn(x, w):
        return torch.func.functional_call(hf, {"weight": w}, (x,))

    expected = _forward_backward(hf_fn, x, hf.weight, grad)
    for got, want in zip(ours, expected):
        assert_close(got, want)
