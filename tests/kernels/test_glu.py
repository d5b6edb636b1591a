"""swiglu / geglu against Hugging Face's `ACT2FN["silu"](gate) * up` and
`ACT2FN["gelu_pytorch_tanh"](gate) * up`: output and both gradients, the in-place backward,
and strided gate/up views of a fused projection."""

from __future__ import annotations

import os

import pytest
import torch
from transformers.activations import ACT2FN

from kestrel.kernels import glu
from kestrel.kernels.glu import geglu, geglu_reference, swiglu, swiglu_reference
from tests.kernels.tolerance import assert_close

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
SHAPES = [(3, 37, 96), (2, 5, 123), (1, 1, 64)]
OPS = {
    "swiglu": (swiglu, swiglu_reference, "silu"),
    "geglu": (geglu, geglu_reference, "gelu_pytorch_tanh"),
}

# The interpreter evaluates sigmoid with NumPy, which warns when exp(-a) overflows to inf for a
# very negative a (the result, 0, is right; CUDA gives the same).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _inputs(shape, dtype, seed=0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # gate spans [-12, 12]: both saturated tails and the curved middle of each activation
    gate = (4.0 * torch.randn(shape, generator=gen)).clamp(-12, 12).to(DEVICE, dtype)
    up = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    grad = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return gate, up, grad


def _run(fn, gate, up, grad) -> list[torch.Tensor]:
    """Output and d/d(gate, up) of fn applied to intermediates of fresh leaves (the in-place
    backward only acts on intermediates, as in an MLP)."""
    gate_leaf, up_leaf = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    out = fn(gate_leaf * 1, up_leaf * 1)
    return [out.detach(), *torch.autograd.grad(out, (gate_leaf, up_leaf), grad)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(OPS))
def test_matches_hf_and_reference(backend, poisoned, shape, dtype, op) -> None:
    fn, reference, act = OPS[op]
    gate, up, grad = _inputs(shape, dtype)
    expected = _run(lambda g, u: ACT2FN[act](g) * u, gate, up, grad)
    ref = _run(reference, gate, up, grad)
    for inplace in (False, True):
        ours = _run(lambda g, u: fn(g, u, inplace_backward=inplace), gate, up, grad)
        for got, want, ref_value in zip(ours, expected, ref):
            assert torch.isfinite(got).all()
            assert_close(got, want)
            assert_close(got, ref_value)


def test_tiles() -> None:
    """Whole rows per program at the 8B MLP's width (SwiGLU to 16,384 columns, GeGLU 8,192);
    decode-sized inputs split rows into 1,024-column programs."""
    assert glu._tiles(8192, 14336, gelu=False) == ((8192, 1), 16384, 16)
    assert glu._tiles(8192, 14336, gelu=True) == ((8192, 2), 8192, 16)
    assert glu._tiles(8192, 3000, gelu=False) == ((8192, 1), 4096, 8)
    assert glu._tiles(8, 14336, gelu=False) == ((8, 14), 1024, 4)


@pytest.mark.parametrize("op", list(OPS))
def test_rows_wider_than_one_tile(monkeypatch, backend, poisoned, op) -> None:
    """Rows over the tile cap take several programs, the last one masked (Qwen2-7B's 18,944
    columns take two 16,384-column SwiGLU programs): caps of 32 columns give 100-column rows
    four programs."""
    monkeypatch.setattr(glu, "_MAX_BLOCK", 32)
    monkeypatch.setattr(glu, "_GELU_MAX_BLOCK", 32)
    monkeypatch.setattr(glu, "_FEW_ROWS", 1)
    assert glu._tiles(15, 100, op == "geglu")[0] == (15, 4)
    fn, _, act = OPS[op]
    gate, up, grad = _inputs((3, 5, 100), torch.bfloat16, seed=1)
    expected = _run(lambda g, u: ACT2FN[act](g) * u, gate, up, grad)
    for inplace in (False, True):
        for got, want in zip(_run(lambda g, u: fn(g, u, inplace_backward=inplace), gate, up, grad), expected):
            assert_close(got, want)


@pytest.mark.parametrize("op", list(OPS))
def test_fused_projection_views(backend, poisoned, op) -> None:
    """gate/up as the two halves of one gate_up projection (row stride 2n, no copy)."""
    fn, _, act = OPS[op]
    gate, up, grad = _inputs((4, 9, 40), torch.float32, seed=1)
    fused = torch.cat([gate, up], dim=-1).requires_grad_()
    got = fn(*fused.chunk(2, dim=-1))
    (d_got,) = torch.autograd.grad(got, fused, grad)
    fused_ref = fused.detach().clone().requires_grad_()
    g_ref, u_ref = fused_ref.chunk(2, dim=-1)
    want = ACT2FN[act](g_ref) * u_ref
    (d_want,) = torch.autograd.grad(want, fused_ref, grad)
    assert_close(got, want)
    assert_close(d_got, d_want)


@pytest.mark.parametrize("op", list(OPS))
def test_inplace_backward_reuses_storage(monkeypatch, op) -> None:
    """d(gate), d(up) land in gate's and up's own memory; a retained graph that would read
    them again fails loudly; leaves are never overwritten."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    fn = OPS[op][0]
    gate, up, grad = _inputs((2, 3, 32), torch.float32, seed=2)
    gate_leaf, up_leaf = gate.clone().requires_grad_(), up.clone().requires_grad_()
    g, u = gate_leaf * 1, up_leaf * 1
    seen = {}
    g.register_hook(lambda d: seen.update(gate=d.data_ptr()))  # returns None: grad unchanged
    u.register_hook(lambda d: seen.update(up=d.data_ptr()))
    out = fn(g, u, inplace_backward=True)
    d_gate, d_up = torch.autograd.grad(out, (g, u), grad, retain_graph=True)
    assert seen == {"gate": g.data_ptr(), "up": u.data_ptr()}
    assert torch.isfinite(d_gate.float() + d_up.float()).all()  # usable with grad mode on
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, (g, u), grad)
    leaf_gate, leaf_up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    fn(leaf_gate, leaf_up, inplace_backward=True).backward(grad)
    assert torch.equal(leaf_gate.detach(), gate) and torch.equal(leaf_up.detach(), up)


def test_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="one shape"):
        swiglu(torch.randn(2, 8), torch.randn(2, 9))


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("inplace", [False, True])
def test_large_cuda(monkeypatch, op, inplace) -> None:
    """Llama-3-8B MLP width on CUDA against HF."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    fn, _, act = OPS[op]
    gen = torch.Generator(device="cpu").manual_seed(3)
    shape = (2, 1024, 14336)
    gate = (3.0 * torch.randn(shape, generator=gen)).to("cuda", torch.bfloat16)
    up = torch.randn(shape, generator=gen).to("cuda", torch.bfloat16)
    grad = torch.randn(shape, generator=gen).to("cuda", torch.bfloat16)
    ours = _run(lambda g, u: fn(g, u, inplace_backward=inplace), gate, up, grad)
    expected = _run(lambda g, u: ACT2FN[act](g) * u, gate, up, grad)
    for got, want in zip(ours, expected):
        assert_close(got, want)
