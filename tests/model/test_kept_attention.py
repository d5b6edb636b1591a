"""kestrel.model.kept_attention: causal attention whose backward starts from the first pass's (out, lse)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.model.kept_attention import CUDNN_CAUSAL, REFERENCE_CAUSAL, kept_attention


def _qkv(hq: int, hkv: int, dtype: torch.dtype, device: str = "cpu", s: int = 13, b: int = 2, d: int = 16):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    make = lambda h: torch.randn(b, h, s, d, generator=gen).to(device, dtype)  # noqa: E731
    return make(hq), make(hkv), make(hkv), torch.randn(b, hq, s, d, generator=gen).to(device, dtype)


def _sdpa_grads(q, k, v, grad, scale):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_reference_kernels_are_causal_sdpa_and_its_gradients(hq: int, hkv: int) -> None:
    q, k, v, grad = _qkv(hq, hkv, torch.float64)
    scale = 0.3
    want, want_grads = _sdpa_grads(q, k, v, grad, scale)
    out, lse = REFERENCE_CAUSAL.forward(q, k, v, scale)
    torch.testing.assert_close(out, want)
    assert lse.shape == (2, hq, 13)
    # The backward from (out, lse) alone, through the Function: no forward recomputed.
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    got = kept_attention(*leaves, (out, lse), scale, REFERENCE_CAUSAL)
    assert torch.equal(got, out)
    got.backward(grad)
    for leaf, expected in zip(leaves, want_grads):
        torch.testing.assert_close(leaf.grad, expected)


def test_a_wrong_kept_lse_gives_wrong_gradients() -> None:
    # The backward reads the kept lse (not a recomputed one): a shifted lse must change dq.
    q, k, v, grad = _qkv(4, 2, torch.float64)
    out, lse = REFERENCE_CAUSAL.forward(q, k, v, 0.25)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    kept_attention(*leaves, (out, lse + 0.5), 0.25, REFERENCE_CAUSAL).backward(grad)
    _, want = _sdpa_grads(q, k, v, grad, 0.25)
    assert not torch.allclose(leaves[0].grad, want[0])


def test_kept_attention_runs_no_forward_kernel() -> None:
    calls: list[str] = []
    forward = lambda *a: calls.append("forward") or REFERENCE_CAUSAL.forward(*a)  # noqa: E731
    kernels = type(REFERENCE_CAUSAL)(forward, REFERENCE_CAUSAL.backward)
    q, k, v, grad = _qkv(4, 4, torch.float32)
    kept = REFERENCE_CAUSAL.forward(q, k, v, 0.25)
    kept_attention(q.requires_grad_(True), k, v, kept, 0.25, kernels).backward(grad)
    assert calls == [] and q.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_cudnn_kernels_match_sdpa_on_cuda(hq: int, hkv: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # As the model lays them out: (B, S, H, D) projections seen as (B, H, S, D); the kept pair comes
    # back from host memory contiguous, whatever strides the kernel gave it.
    q, k, v, grad = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in
                     _qkv(hq, hkv, torch.bfloat16, "cuda", s=1024, b=2, d=128))
    scale = 128 ** -0.5
    want, want_grads = _sdpa_grads(q, k, v, grad, scale)
    out, lse = CUDNN_CAUSAL.forward(q, k, v, scale)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    _, ref_lse = REFERENCE_CAUSAL.forward(q, k, v, scale)
    torch.testing.assert_close(lse.float().reshape(ref_lse.shape), ref_lse, rtol=1e-3, atol=1e-3)
    bshd = out.transpose(1, 2).contiguous().transpose(1, 2)
    for kept in ((out, lse), (out.contiguous(), lse.contiguous()), (bshd, lse)):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        kept_attention(*leaves, kept, scale, CUDNN_CAUSAL).backward(grad)
        for leaf, expected in zip(leaves, want_grads):
            torch.testing.assert_close(leaf.grad, expected, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
def test_cuda_training_shapes_take_cudnn_and_fp32_takes_nothing() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kestrel.model.kept_attention import causal_kernels

    q, k, v, _ = _qkv(8, 2, torch.bfloat16, "cuda", s=256, b=1, d=128)
    assert causal_kernels(q, k, v) is CUDNN_CAUSAL
    q, k, v, _ = _qkv(8, 2, torch.float32, "cuda", s=256, b=1, d=128)
    assert causal_kernels(q, k, v) is None


def test_the_cpu_takes_the_reference() -> None:
    from kestrel.model.kept_attention import causal_kernels

    q, k, v, _ = _qkv(4, 2, torch.float32)
    assert causal_kernels(q, k, v) is REFERENCE_CAUSAL


@pytest.mark.parametrize("perm", [(0, 1, 2, 3), (0, 2, 1, 3), (2, 0, 1, 3), (1, 2, 0, 3)])
def test_cudnn_backward_lays_o_out_as_the_forward_would(perm: tuple[int, int, int, int]) -> None:
    # cuDNN's forward gives O q's layout (dense, dims ordered as q's strides); O and dO reach the
    # backward in it whatever layout they were kept in, or a graph cached for q's layout misreads them.
    from kestrel.model.kept_attention import _dense_strides_like, _in_layout

    sizes = (2, 3, 5, 4)
    q = torch.randn(*(sizes[p] for p in perm)).permute(*sorted(range(4), key=perm.__getitem__))
    assert q.shape == sizes
    assert _dense_strides_like(q, q.shape) == torch.empty_like(q).stride()
    wider = _dense_strides_like(q, (2, 3, 5, 8))  # O's head size may differ from q's: same order, dense
    assert sorted(range(4), key=wider.__getitem__) == sorted(range(4), key=q.stride().__getitem__)
    o = torch.randn(sizes)
    moved = _in_layout(o, _dense_strides_like(q, o.shape))
    assert moved.stride() == q.stride() and torch.equal(moved, o)
    assert _in_layout(moved, moved.stride()) is moved
