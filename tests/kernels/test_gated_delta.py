"""`kestrel.kernels.gated_delta.chunk_dqkwg`: each chunk's gradients of q, k, w and the gate equal
autograd's through the chunk's own equations (written out here chunk by chunk, in float64), also
where the last chunk is partial and where keys and values differ in width."""

from __future__ import annotations

import functools
import inspect
import math

import pytest
import torch

from kestrel.kernels import gated_delta
from kestrel.kernels.gated_delta import CHUNK, chunk_dqkwg


def _chunk_objective(q, k, w, g, v_new, u, h, do, dh, dv, scale):  # type: ignore[no-untyped-def]
    """<do, o> + <dh_c, h_c+1> + <dv, u - w h_c> summed over chunks, from the module docstring's
    equations: o = s (q 2^g2) h_c + s [(q k^T) 2^(g2_i - g2_j) (i >= j)] v_new, h_c+1 = 2^g2_L h_c
    + (k 2^(g2_L - g2))^T v_new, with g2 = g / ln 2 (g the natural-log cumulative gate)."""
    g2 = g / math.log(2)
    t, total = q.shape[1], q.new_zeros(())
    for c in range(math.ceil(t / CHUNK)):
        sl = slice(c * CHUNK, min((c + 1) * CHUNK, t))
        qc, kc, wc, gc, vc, uc = q[:, sl], k[:, sl], w[:, sl], g2[:, sl], v_new[:, sl], u[:, sl]
        hc = h[:, c]  # (B, H, K, V)
        o = torch.einsum("bthk,bhkv->bthv", qc * torch.exp2(gc)[..., None], hc) * scale
        n = qc.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        gate = torch.exp2((gc[:, :, None] - gc[:, None, :]).permute(0, 3, 1, 2).masked_fill(~causal, -math.inf))
        scores = torch.einsum("bihk,bjhk->bhij", qc, kc) * gate
        o = o + torch.einsum("bhij,bjhv->bihv", scores, vc) * scale
        g_last = gc[:, -1]  # (B, H)
        nxt = torch.exp2(g_last)[..., None, None] * hc + torch.einsum(
            "bthk,bthv->bhkv", kc * torch.exp2(g_last[:, None] - gc)[..., None], vc)
        corrected = uc - torch.einsum("bthk,bhkv->bthv", wc, hc)
        total = total + (do[:, sl] * o).sum() + (dh[:, c] * nxt).sum() + (dv[:, sl] * corrected).sum()
    return total


@pytest.mark.parametrize("one_head_at_a_time", [False, True])
@pytest.mark.parametrize(("t", "heads", "dk", "dv"), [(150, 3, 16, 24), (128, 2, 32, 16), (40, 1, 8, 8)])
def test_chunk_gradients_equal_autograd_through_the_chunk_equations(
        t: int, heads: int, dk: int, dv: int, one_head_at_a_time: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if one_head_at_a_time:  # a working memory too small for two heads: the heads go one by one
        monkeypatch.setattr(gated_delta, "WORKING_BYTES", 1)
    gen = torch.Generator().manual_seed(t)
    batch, n = 2, math.ceil(t / CHUNK)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, w = (rnd(batch, t, heads, dk).requires_grad_() for _ in range(3))
    steps = -torch.nn.functional.softplus(rnd(batch, t, heads)) * 0.3
    # the within-chunk cumulative natural-log gate, as flash-linear-attention's first stage leaves it
    g = torch.cat([steps[:, i:i + CHUNK].cumsum(1) for i in range(0, t, CHUNK)], 1).requires_grad_()
    v_new, u, do, grad_v = (rnd(batch, t, heads, dv) for _ in range(4))
    h, dh = rnd(batch, n, heads, dk, dv), rnd(batch, n, heads, dk, dv)
    scale = dk ** -0.5
    _chunk_objective(q, k, w, g, v_new, u, h, do, dh, grad_v, scale).backward()

    dq, dk_, dw, dg = chunk_dqkwg(q.detach(), k.detach(), v_new, w.detach(), g.detach() / math.log(2),
                                  h, grad_v, do, dh, scale)
    for name, got, want in (("dq", dq, q.grad), ("dk", dk_, k.grad), ("dw", dw, w.grad), ("dg", dg, g.grad)):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)


def test_chunk_gradients_keep_the_input_dtype() -> None:
    q = torch.randn(1, 70, 2, 8, dtype=torch.bfloat16)
    v = torch.randn(1, 70, 2, 4, dtype=torch.bfloat16)
    h = torch.randn(1, 2, 2, 8, 4, dtype=torch.bfloat16)
    g = torch.zeros(1, 70, 2)
    dq, dk, dw, dg = chunk_dqkwg(q, q, v, q, g, h, v, v, h, 0.5)
    assert (dq.dtype, dk.dtype, dw.dtype, dg.dtype) == (torch.bfloat16,) * 3 + (torch.float32,)
    assert torch.isfinite(dg).all()


@pytest.mark.parametrize(("hopper", "dk", "dv", "want"), [
    (True, 128, 128, (128, 128)), (True, 96, 64, (128, 64)), (True, 256, 128, (128, 128)), (True, 128, 16, (128, 16)),
    (True, 64, 128, None), (True, 32, 64, None), (True, 16, 16, None), (False, 128, 128, None),
])
def test_the_kernel_way_launches_only_the_key_tile_it_is_right_at(hopper: bool, dk: int, dv: int, want, monkeypatch) -> None:
    """Key tiles of 64 and 32 give wrong gradients on Hopper under Triton 3.4-3.7.0; the launcher
    takes 128 or refuses (the probe then moves on to the PyTorch way)."""
    pytest.importorskip("fla")
    import fla.utils

    monkeypatch.setattr(fla.utils, "check_shared_mem", lambda arch, index=0: hopper or arch != "hopper")
    q, v = torch.zeros(1, 8, 2, dk, dtype=torch.bfloat16), torch.zeros(1, 8, 2, dv, dtype=torch.bfloat16)
    if want is None:
        with pytest.raises(gated_delta.TileRefused, match="key tile of 128"):
            gated_delta._dqkwg_tiles(q, v)
    else:
        assert gated_delta._dqkwg_tiles(q, v) == want


@pytest.mark.gpu
@pytest.mark.parametrize("way", list(gated_delta.DQKWG))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "t", "heads", "dk", "dv", "with_state"), [
    (1, 200, 4, 64, 64, False), (2, 128, 2, 128, 128, False), (1, 70, 3, 32, 64, True), (1, 100, 2, 96, 48, True),
])
def test_the_stand_in_equals_hfs_reference_on_cuda(batch: int, t: int, heads: int, dk: int, dv: int,
                                                    with_state: bool, dtype: torch.dtype, way: str) -> None:
    """flash-linear-attention's stages with each of Kestrel's ways for its refused one give HF's
    PyTorch function's output, final state and gradients (that function in fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    reference = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)  # HF's wrapper calls fla's kernel

    if not gated_delta.available():
        pytest.skip("flash-linear-attention is not installed")
    gen = torch.Generator().manual_seed(t)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).cuda()

    q, k, v = rnd(batch, t, heads, dk), rnd(batch, t, heads, dk), rnd(batch, t, heads, dv)
    g, beta = -torch.nn.functional.softplus(rnd(batch, t, heads)), rnd(batch, t, heads).sigmoid()
    state = rnd(batch, heads, dk, dv) * 0.1 if with_state else None
    grad_out, grad_state = rnd(batch, t, heads, dv), rnd(batch, heads, dk, dv)

    def run(fn, wanted: torch.dtype) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        xs = [x.to(dt, copy=True).requires_grad_() for x, dt in zip((q, k, v, g, beta), (wanted,) * 3 + (g.dtype, wanted))]
        h0 = state.clone().requires_grad_() if state is not None else None
        out, final = fn(xs[0], xs[1], xs[2], g=xs[3], beta=xs[4], initial_state=h0,
                        output_final_state=with_state, use_qk_l2norm_in_kernel=True)
        loss = (out.float() * grad_out).sum() + ((final.float() * grad_state).sum() if with_state else 0)
        loss.backward()
        got = [out.detach().float()] + [x.grad.float() for x in xs]
        return got + ([final.detach().float(), h0.grad.float()] if with_state else [])

    stand_in = functools.partial(gated_delta.chunk_gated_delta_rule, dqkwg=way)
    if way == "kernel" and dk <= 64:  # key tiles narrower than 128 are refused (wrong there)
        with pytest.raises(gated_delta.TileRefused, match="key tile of 128"):
            run(stand_in, dtype)
        return
    got, want = run(stand_in, dtype), run(reference, torch.float32)
    limit = 5e-3 if dtype == torch.float32 else 3e-2
    names = [*gated_delta.OUTPUTS, "final state", "d initial state"]
    for name, a, b in zip(names, got, want):
        assert float((a - b).norm() / b.norm()) < limit, name
