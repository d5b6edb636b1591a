"""rope_ against Hugging Face's `apply_rotary_pos_emb` on q/k built as HF builds them (leaf ->
linear -> view -> transpose): rotated values and the gradients of the leaf and both weights,
GQA, packed position ids, shared tables, aliased gradients, and the in-place contract."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kestrel.kernels.rope import _grad_buffers, _plan_of, rope_, rope_reference_
from tests.kernels.tolerance import assert_close

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# (batch, seq, heads_q, heads_k, head_dim): GQA, odd sizes, a half head_dim that is no power of 2;
# small heads run several tokens a program (masked past seq), Llama-sized heads one token a
# program, with an exact tile (32 + 8 heads of 128) and a masked one (24 q heads).
SHAPES = [(3, 37, 4, 2, 32), (2, 5, 3, 1, 24), (1, 1, 2, 2, 64), (1, 3, 32, 8, 128), (2, 3, 24, 8, 128)]
MODEL_DIM = 16


def _rotary(heads_q: int, heads_k: int, head_dim: int) -> LlamaRotaryEmbedding:
    config = LlamaConfig(hidden_size=heads_q * head_dim, num_attention_heads=heads_q,
                         num_key_value_heads=heads_k, head_dim=head_dim, max_position_embeddings=64)
    return LlamaRotaryEmbedding(config).to(DEVICE)


class Projections:
    """Leaf activations and q/k weights; `qk()` builds q, k exactly as HF attention does."""

    def __init__(self, batch: int, seq: int, heads_q: int, heads_k: int, head_dim: int,
                 dtype: torch.dtype, layout: str = "hf") -> None:
        self.shape = (batch, seq, heads_q, heads_k, head_dim)
        # "hf": transposed views of whole linear outputs; "contiguous": not views at all;
        # "fused": slices of one QKV projection (partial views: rope_'s general path).
        self.layout = layout
        self.x = torch.randn(batch, seq, MODEL_DIM, device=DEVICE).to(dtype)
        self.wq = (torch.randn(heads_q * head_dim, MODEL_DIM, device=DEVICE) / 4).to(dtype)
        self.wk = (torch.randn(heads_k * head_dim, MODEL_DIM, device=DEVICE) / 4).to(dtype)

    def leaves(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach().clone().requires_grad_() for t in (self.x, self.wq, self.wk))

    def qk(self, x, wq, wk) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, heads_q, heads_k, head_dim = self.shape
        if self.layout == "fused":
            qk = torch.nn.functional.linear(x, torch.cat([wq, wk]))
            q, k = qk[..., : heads_q * head_dim], qk[..., heads_q * head_dim :]
        else:
            q, k = torch.nn.functional.linear(x, wq), torch.nn.functional.linear(x, wk)
        q = q.view(batch, seq, heads_q, head_dim).transpose(1, 2)
        k = k.view(batch, seq, heads_k, head_dim).transpose(1, 2)
        return (q.contiguous(), k.contiguous()) if self.layout == "contiguous" else (q, k)

    def run(self, rotate, loss=None) -> list[torch.Tensor]:
        """Rotated q, k and d(loss)/d(x, wq, wk); default loss: a fixed random projection."""
        leaves = self.leaves()
        q_out, k_out = rotate(*self.qk(*leaves))
        if loss is None:
            gen = torch.Generator(device="cpu").manual_seed(7)
            gq = torch.randn(q_out.shape, generator=gen).to(q_out)
            gk = torch.randn(k_out.shape, generator=gen).to(k_out)
            value = (q_out.float() * gq.float()).sum() + (k_out.float() * gk.float()).sum()
        else:
            value = loss(q_out, k_out)
        return [q_out.detach(), k_out.detach(), *torch.autograd.grad(value, leaves)]


def _check_all(proj: Projections, cos, sin, position_ids=None, loss=None) -> None:
    """Ours vs HF's apply_rotary_pos_emb and vs the reference: values and all three gradients."""
    cos_g, sin_g = (cos, sin) if position_ids is None else (cos[position_ids], sin[position_ids])
    expected = proj.run(lambda q, k: apply_rotary_pos_emb(q, k, cos_g, sin_g), loss)
    reference = proj.run(lambda q, k: rope_reference_(q, k, cos, sin, position_ids), loss)
    ours = proj.run(lambda q, k: rope_(q, k, cos, sin, position_ids), loss)
    for got, want, ref in zip(ours, expected, reference):
        assert torch.isfinite(got).all()
        assert_close(got, want)
        assert_close(got, ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf_with_hf_tables(backend, poisoned, shape, dtype) -> None:
    torch.manual_seed(0)
    batch, seq, heads_q, heads_k, head_dim = shape
    proj = Projections(*shape, dtype)
    position_ids = torch.arange(seq, device=DEVICE).repeat(batch, 1) + torch.arange(batch, device=DEVICE)[:, None]
    cos, sin = _rotary(heads_q, heads_k, head_dim)(proj.x, position_ids)  # (batch, seq, head_dim)
    _check_all(proj, cos, sin)


@pytest.mark.parametrize("layout", ["contiguous", "fused"])
def test_other_layouts(backend, poisoned, layout) -> None:
    """q, k that are not views, and q, k that are slices of one fused QKV output."""
    torch.manual_seed(6)
    batch, seq, heads_q, heads_k, head_dim = 2, 7, 4, 2, 16
    proj = Projections(batch, seq, heads_q, heads_k, head_dim, torch.float32, layout)
    position_ids = torch.arange(seq, device=DEVICE).repeat(batch, 1) + torch.arange(batch, device=DEVICE)[:, None]
    cos, sin = _rotary(heads_q, heads_k, head_dim)(proj.x, position_ids)  # (batch, seq, head_dim)
    _check_all(proj, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_position_ids(backend, poisoned, dtype) -> None:
    """Tables (max_pos, head_dim) indexed by ids that restart inside each packed row."""
    torch.manual_seed(1)
    proj = Projections(2, 9, 4, 2, 32, dtype)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8]], device=DEVICE)
    table_ids = torch.arange(16, device=DEVICE)[None]
    cos, sin = (t[0] for t in _rotary(4, 2, 32)(proj.x, table_ids))  # (16, head_dim)
    _check_all(proj, cos, sin, position_ids)
    _check_all(proj, cos, sin, position_ids[1:])  # one id row shared by the batch


def test_table_shared_over_batch(backend) -> None:
    """cos/sin (1, seq, head_dim) broadcast over a batch of 3."""
    torch.manual_seed(2)
    proj = Projections(3, 7, 2, 1, 16, torch.float32)
    cos, sin = _rotary(2, 1, 16)(proj.x, torch.arange(7, device=DEVICE)[None])
    _check_all(proj, cos, sin)


@pytest.mark.parametrize("layout", ["hf", "contiguous", "fused"])
def test_same_gradient_tensor_for_q_and_k(backend, poisoned, layout) -> None:
    """`q_out + k_out` makes autograd hand one gradient tensor to both: rotating it in place
    for q would corrupt k's gradient."""
    torch.manual_seed(3)
    proj = Projections(2, 5, 2, 2, 16, torch.float32, layout)
    cos, sin = _rotary(2, 2, 16)(proj.x, torch.arange(5, device=DEVICE)[None])
    _check_all(proj, cos, sin, loss=lambda q, k: (q + k).pow(2).sum())
    _check_all(proj, cos, sin, loss=lambda q, k: (q + k).sum())  # expanded, stride-0 gradient


@pytest.mark.parametrize("layout", ["hf", "contiguous", "fused"])
def test_inplace_backward_gradients(backend, poisoned, layout) -> None:
    """inplace_backward=True gives HF's gradients with fresh, expanded (`.sum()`) and shared
    (`q + k`: one tensor for both) output gradients."""
    torch.manual_seed(7)
    cases = [
        ((4, 2), None),
        ((4, 2), lambda q, k: (q + q).pow(2).sum() + k.sum()),
        ((4, 2), lambda q, k: q.sum() + k.sum()),
        ((2, 2), lambda q, k: (q + k).pow(2).sum()),
    ]
    for (heads_q, heads_k), loss in cases:
        proj = Projections(2, 5, heads_q, heads_k, 16, torch.float32, layout)
        cos, sin = _rotary(heads_q, heads_k, 16)(proj.x, torch.arange(5, device=DEVICE)[None])
        expected = proj.run(lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), loss)
        ours = proj.run(lambda q, k: rope_(q, k, cos, sin, inplace_backward=True), loss)
        for got, want in zip(ours, expected):
            assert_close(got, want)


@pytest.mark.parametrize("layout", ["hf", "fused"])
@pytest.mark.parametrize("inplace", [False, True])
def test_inplace_backward_overwrites_only_when_asked(backend, layout, inplace) -> None:
    """The caller's output gradients are left alone by default (and on the general, fused
    path); with inplace_backward=True on the one-launch path they become d(loss)/d(q, k)."""
    torch.manual_seed(8)
    proj = Projections(2, 5, 4, 2, 16, torch.float32, layout)
    cos, sin = _rotary(4, 2, 16)(proj.x, torch.arange(5, device=DEVICE)[None])
    leaves = proj.leaves()
    q_out, k_out = rope_(*proj.qk(*leaves), cos, sin, inplace_backward=inplace)
    grads = torch.randn_like(q_out), torch.randn_like(k_out)  # laid out like q_out, k_out
    saved = tuple(g.clone() for g in grads)
    torch.autograd.grad((q_out, k_out), leaves, grads)
    if backend == "triton" and inplace and layout == "hf":
        q_ref, k_ref = (t.detach().clone().requires_grad_() for t in proj.qk(proj.x, proj.wq, proj.wk))
        want = torch.autograd.grad(apply_rotary_pos_emb(q_ref, k_ref, cos, sin), (q_ref, k_ref), saved)
    else:
        want = saved
    for got, expected in zip(grads, want):
        assert_close(got, expected)


def test_grad_buffers_policy() -> None:
    """Which root gradients the backward overwrites: its own copies always, the caller's only
    when promised and not sharing memory, none under create_graph (grad mode on)."""
    a, b = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    expanded = torch.randn(1, 1, 32).expand(2, 5, 32)
    with torch.no_grad():
        for promised, want in ((False, (False, False)), (True, (True, True))):
            dq, dk, out_q, out_k = _grad_buffers(a, b, promised)
            assert dq is a and dk is b and (out_q is a, out_k is b) == want
        dq, dk, out_q, out_k = _grad_buffers(a, a, True)  # `q + k`: one tensor for both
        assert out_q is not a and out_k is not a
        dq, dk, out_q, out_k = _grad_buffers(expanded, b, False)
        assert out_q is dq and dq.is_contiguous() and out_k is not b
    with torch.enable_grad():
        dq, _, out_q, out_k = _grad_buffers(expanded, b, True)
        assert out_q is not dq and out_k is not b


def test_in_place_contract(backend) -> None:
    """Returns the very tensors passed in, bumps their version without grad, refuses leaves."""
    torch.manual_seed(4)
    proj = Projections(2, 5, 2, 1, 16, torch.float32)
    cos, sin = _rotary(2, 1, 16)(proj.x, torch.arange(5, device=DEVICE)[None])
    with torch.no_grad():
        q, k = proj.qk(proj.x, proj.wq, proj.wk)
        versions = (q._version, k._version)
        q_want, k_want = apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin)
        q_out, k_out = rope_(q, k, cos, sin)
    assert q_out is q and k_out is k
    assert q._version > versions[0] and k._version > versions[1]
    assert_close(q, q_want)
    assert_close(k, k_want)
    # With grad: the returned tensors share q's and k's memory and strides (HF layout).
    q, k = proj.qk(*proj.leaves())
    q_out, k_out = rope_(q, k, cos, sin)
    for before, after in ((q, q_out), (k, k_out)):
        assert after.data_ptr() == before.data_ptr()
        assert all(after.stride(i) == before.stride(i) for i in range(4) if before.shape[i] > 1)
    assert torch.equal(q.detach(), q_out.detach())
    if backend == "triton":  # one autograd node, without the copies of an in-place view update
        assert type(q_out.grad_fn).__name__ == "PermuteBackward0"
    leaf = torch.randn(1, 1, 5, 16, device=DEVICE, requires_grad=True)
    saved = leaf.detach().clone()
    for k_in in (leaf, leaf.view(1, 1, 5, 16)):
        with pytest.raises(RuntimeError, match="leaf"):
            rope_(torch.zeros(1, 1, 5, 16, device=DEVICE), k_in, cos[:1], sin[:1])
        assert torch.equal(leaf.detach(), saved)


def test_q_k_after_qk_norm_keep_their_gradient(backend: str) -> None:
    """Found on the GPU (Qwen3: QK-norm -> transpose -> rope_): the Triton RMSNorm's output must
    be a tensor rope_ may rotate in place, and the gradient must reach the norm's input and weight."""
    from kestrel.kernels.rms_norm import rms_norm

    rotary = _rotary(2, 1, 16)
    cos, sin = rotary(torch.zeros(1, device=DEVICE), torch.arange(5, device=DEVICE).unsqueeze(0))
    xq = torch.randn(1, 5, 2, 16, device=DEVICE, requires_grad=True)
    xk = torch.randn(1, 5, 1, 16, device=DEVICE, requires_grad=True)
    w = torch.rand(16, device=DEVICE, requires_grad=True)
    q_out, k_out = rope_(rms_norm(xq, w, 1e-6).transpose(1, 2), rms_norm(xk, w, 1e-6).transpose(1, 2), cos, sin)
    q_want, k_want = apply_rotary_pos_emb(
        rope_reference_norm(xq, w).transpose(1, 2), rope_reference_norm(xk, w).transpose(1, 2), cos, sin
    )
    assert_close(q_out, q_want)
    assert_close(k_out, k_want)
    gq, gk = torch.randn_like(q_want), torch.randn_like(k_want)
    want = torch.autograd.grad((q_want * gq).sum() + (k_want * gk).sum(), (xq, xk, w))
    got = torch.autograd.grad((q_out * gq).sum() + (k_out * gk).sum(), (xq, xk, w))
    for g, expected in zip(got, want):
        assert_close(g, expected)


def rope_reference_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_plans_follow_shape_and_strides(backend, poisoned) -> None:
    """Launch parameters are cached per geometry (`_plan`): one shape in several layouts, then
    another sequence length, back to back, each against HF, with and without grad; the same
    geometry gets the same plan, other strides or tables another."""
    torch.manual_seed(10)
    for seq, layout in [(5, "hf"), (5, "contiguous"), (5, "fused"), (9, "hf"), (5, "hf")]:
        proj = Projections(2, seq, 4, 2, 16, torch.float32, layout)
        cos, sin = _rotary(4, 2, 16)(proj.x, torch.arange(seq, device=DEVICE)[None])
        _check_all(proj, cos, sin)
        with torch.no_grad():
            q, k = proj.qk(proj.x, proj.wq, proj.wk)
            want = apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin)
            rope_(q, k, cos, sin)
        assert_close(q, want[0])
        assert_close(k, want[1])
    q = torch.zeros(2, 4, 5, 16)
    k = torch.zeros(2, 2, 5, 16)
    cos = torch.zeros(1, 5, 16)
    plan = _plan_of(q, k, cos, cos, None)
    assert _plan_of(q.clone(), k.clone(), cos.clone(), cos.clone(), None) is plan
    q_t = torch.zeros(2, 5, 4, 16).transpose(1, 2)  # same shape, other strides
    assert _plan_of(q_t, k, cos, cos, None).launch != plan.launch
    per_batch = torch.zeros(2, 5, 16)  # one table per sequence: a batch stride of 80
    assert _plan_of(q, k, per_batch, per_batch, None).tables[0] == 80 and plan.tables[0] == 0
    wide = torch.zeros(1, 5, 32)[..., :16]  # cos/sin rows of stride 32, as a slice gives
    assert _plan_of(q, k, wide, wide, None).launch != plan.launch


def test_rejects_bad_tables() -> None:
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 5, 16)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_(q, k, torch.randn(1, 4, 16), torch.randn(1, 4, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_cuda(monkeypatch, dtype) -> None:
    """Llama-3-8B attention shape on CUDA against HF."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    torch.manual_seed(5)
    batch, seq, heads_q, heads_k, head_dim = 2, 2048, 32, 8, 128
    q = torch.randn(batch, seq, heads_q, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, seq, heads_k, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
    rotary = _rotary(heads_q, heads_k, head_dim).cuda()
    cos, sin = rotary(q, torch.arange(seq, device="cuda")[None].expand(batch, -1))
    q_want, k_want = apply_rotary_pos_emb(q, k, cos, sin)
    rope_(q, k, cos, sin)
    assert_close(q, q_want)
    assert_close(k, k_want)


@pytest.mark.gpu
def test_beyond_int32_offsets(monkeypatch) -> None:
    """q with more than 2^31 elements (4.3 GB in bf16): the last tokens must rotate correctly."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    heads, head_dim = 8, 128
    seq = 2**31 // (heads * head_dim) + 64
    q = torch.ones(1, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.ones(1, 1, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    position_ids = (torch.arange(seq, device="cuda") % 4096)[None]
    cos, sin = (t[0] for t in _rotary(heads, 1, head_dim).cuda()(q[:, 0], torch.arange(4096, device="cuda")[None]))
    tail_q, tail_k = q[:, :, -64:].clone(), k[:, :, -64:].clone()
    rope_reference_(tail_q, tail_k, cos, sin, position_ids[:, -64:])
    rope_(q, k, cos, sin, position_ids)
    assert_close(q[:, :, -64:], tail_q)
    assert_close(k[:, :, -64:], tail_k)
