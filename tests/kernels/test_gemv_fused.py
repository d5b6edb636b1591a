"""The decode layer's fused products (kernels/gemv_fused.py) against plain PyTorch in float64:
RoPE'd q, the K/V cache writes (and nothing else of the cache touched), biases, GQA head
counts, SiLU and tanh-GELU gates, an intermediate size that is no multiple of any block, the
residual add with the RMSNorm split across launches (residual's u and sum of squares, finished
by the next product's `norm`), an unmerged adapter's shrink split the same way (the producing
launch's partial sums of A h, `ahead`, consumed with `lora`), weights that are row slices of a
larger buffer, and poisoned outputs. On CUDA the 8B shapes run many times in a row."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kestrel.kernels.decode.gemv_fused import embed_start, glu, qkv_rope_cache, residual

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if CUDA else "cpu"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _tables(length: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(length, dtype=torch.float64)[:, None] * inv
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos(), emb.sin()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 1e-5 if got.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(1.0, float(want.abs().max())))


@pytest.fixture(autouse=True)
def _triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,d,k,bias,normed", [(4, 2, 16, 72, True, True), (3, 3, 24, 40, False, False),
                                                     (8, 1, 8, 130, True, False), (2, 1, 32, 48, False, True)])
def test_qkv_rope_cache(heads: int, kv: int, d: int, k: int, bias: bool, normed: bool, dtype: torch.dtype,
                        poisoned) -> None:
    gen = torch.Generator().manual_seed(heads * d + k)
    rows, length, col, pad = (heads + 2 * kv) * d, 20, 9, 3
    buf = torch.randn(rows + 5, k, generator=gen, dtype=torch.float64) / k**0.5  # a slice of a fused buffer
    b = torch.randn(rows, generator=gen, dtype=torch.float64) if bias else None
    h = torch.randn(k, generator=gen, dtype=torch.float64)
    cos, sin = _tables(length, d)
    cache = torch.zeros(2, 2, 1, kv, length, d, dtype=dtype)
    dev = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    cache = cache.to(DEVICE)
    ss = torch.tensor([float(k) * 2.5], dtype=torch.float32, device=DEVICE)  # rsqrt(2.5 + eps)
    q = qkv_rope_cache(dev(h), dev(buf)[:rows], dev(b), dev(cos), dev(sin), torch.tensor([col], device=DEVICE),
                       torch.tensor([pad], device=DEVICE), cache[1, 0], cache[1, 1], heads,
                       norm=(ss, 1e-3) if normed else None)
    y = (buf[:rows] @ h) * (2.501**-0.5 if normed else 1.0) + (b if bias else 0)
    qr, kr, vr = y.split([heads * d, kv * d, kv * d])
    c, s = cos[col - pad], sin[col - pad]
    rope = lambda x: x * c + _rotate_half(x) * s  # noqa: E731
    _close(q, rope(qr.view(heads, d)))
    _close(cache[1, 0, 0, :, col], rope(kr.view(kv, d)))
    _close(cache[1, 1, 0, :, col], vr.view(kv, d))
    cache[1, :, 0, :, col] = 0
    assert not cache.any(), "only column col of layer 1's K and V may change"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("inter,k,normed", [(37, 72, True), (8, 2500, False), (64, 24, True)])
def test_glu(inter: int, k: int, normed: bool, gelu: bool, dtype: torch.dtype, poisoned) -> None:
    gen = torch.Generator().manual_seed(inter + k)
    w = torch.randn(2 * inter + 3, k, generator=gen, dtype=torch.float64) / k**0.5
    h = torch.randn(k, generator=gen, dtype=torch.float64)
    ss = torch.tensor([float(k) * 0.25], dtype=torch.float32, device=DEVICE)  # rsqrt(0.25 + 0) = 2
    out = glu(h.to(DEVICE, dtype), w.to(DEVICE, dtype), inter, gelu=gelu, norm=(ss, 0.0) if normed else None)
    r = 2.0 if normed else 1.0
    gate, up = r * (w[:inter] @ h), r * (w[inter : 2 * inter] @ h)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    assert out.shape == (inter,)
    _close(out, act * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(50, 72), (33, 2500), (64, 16)])
def test_residual_then_normed_product(n: int, k: int, dtype: torch.dtype, poisoned) -> None:
    """residual's (x', u, ss) and glu's `norm` together equal act(W_g h) * (W_u h) of h = RMSNorm(x')."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n + 7, k, generator=gen, dtype=torch.float64) / k**0.5
    a, res = torch.randn(k, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    nw = torch.randn(n, generator=gen, dtype=torch.float64)
    w_next = torch.randn(2 * 5, n, generator=gen, dtype=torch.float64) / n**0.5
    ss = torch.full((3,), 7.0, dtype=torch.float32, device=DEVICE)[1:2].zero_()
    dev = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    x, u = residual(dev(a), dev(w)[7:], dev(res), dev(nw), ss)
    xr = res + w[7:] @ a
    _close(x, xr)
    _close(u, nw * xr)
    _close(ss, x.double().pow(2).sum()[None])  # of x' as stored (its own rounding)
    m = glu(u, dev(w_next), 5, norm=(ss, 1e-6))
    h = nw * xr * torch.rsqrt(xr.pow(2).mean() + 1e-6)
    _close(m, F.silu(w_next[:5] @ h) * (w_next[5:] @ h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,inter,r,slots", [(50, 72, 37, 3, 4), (64, 40, 96, 8, 1), (33, 2500, 20, 5, 16)])
def test_adapter_shrinks_across_launches(n: int, k: int, inter: int, r: int, slots: int, dtype: torch.dtype,
                                         poisoned) -> None:
    """residual (o + adapter, then the gate/up adapter's partial sums) -> glu (adapter finished
    with the norm's rsqrt, then down's partial sums) -> residual (down + adapter) equals the
    float64 layer half with every adapter applied: y = W h + B (A h)."""
    gen = torch.Generator().manual_seed(n + r)
    rnd = lambda *shape, s=1.0: torch.randn(*shape, generator=gen, dtype=torch.float64) * s  # noqa: E731
    w_o, w_gu, w_down = rnd(n, k, s=k**-0.5), rnd(2 * inter, n, s=n**-0.5), rnd(n, inter, s=inter**-0.5)
    a_o, a_gu, a_down = rnd(r, k, s=k**-0.5), rnd(r + 2, n, s=n**-0.5), rnd(r, inter, s=inter**-0.5)
    b_o, b_gu, b_down = rnd(n, r, s=0.3), rnd(2 * inter, r + 2, s=0.3), rnd(n, r, s=0.3)
    a, res, nw, nw2 = rnd(k), rnd(n), rnd(n), rnd(n)
    dev = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    sums = torch.full((2,), 3.0, dtype=torch.float32, device=DEVICE).zero_()
    parts = torch.full((2, slots, 16), 9.0, dtype=torch.float32, device=DEVICE).zero_()
    t_o = (dev(a_o) @ dev(a)).float()  # o's shrink as its own launch would give it, (r,)
    x, u = residual(dev(a), dev(w_o), dev(res), dev(nw), sums[0:1], lora=(dev(b_o), t_o),
                    ahead=(dev(a_gu), parts[0, :, : r + 2]))
    m = glu(u, dev(w_gu), inter, norm=(sums[0:1], 1e-6), lora=(dev(b_gu), parts[0]), ahead=(dev(a_down), parts[1]))
    x2, _ = residual(m, dev(w_down), x, dev(nw2), sums[1:2], lora=(dev(b_down), parts[1]))
    xr = res + w_o @ a + b_o @ (a_o @ a)
    h = nw * xr * torch.rsqrt(xr.pow(2).mean() + 1e-6)
    gu = w_gu @ h + b_gu @ (a_gu @ h)
    mr = F.silu(gu[:inter]) * gu[inter:]
    _close(x, xr)
    _close(m, mr)
    _close(x2, xr + w_down @ mr + b_down @ (a_down @ mr))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_adapter_from_partial_sums(dtype: torch.dtype, poisoned) -> None:
    """residual's partial sums of the next q/k/v adapter's A u, consumed by qkv_rope_cache with
    the norm: q = RoPE(W h + B A h), h = RMSNorm(x')."""
    gen = torch.Generator().manual_seed(5)
    heads, kv, d, n, k, r = 2, 1, 8, 32, 24, 6
    rows = (heads + 2 * kv) * d
    w, w_qkv = torch.randn(n, k, generator=gen, dtype=torch.float64), torch.randn(rows, n, generator=gen, dtype=torch.float64)
    lora_a, lora_b = torch.randn(r, n, generator=gen, dtype=torch.float64), torch.randn(rows, r, generator=gen, dtype=torch.float64)
    a, res, nw = (torch.randn(s, generator=gen, dtype=torch.float64) for s in (k, n, n))
    cos, sin = _tables(8, d)
    dev = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    ss = torch.zeros(1, dtype=torch.float32, device=DEVICE)
    parts = torch.zeros(4, 8, dtype=torch.float32, device=DEVICE)
    cache = torch.zeros(2, 1, kv, 8, d, dtype=dtype, device=DEVICE)
    _, u = residual(dev(a) / k, dev(w), dev(res), dev(nw), ss, ahead=(dev(lora_a) / n, parts))
    q = qkv_rope_cache(u, dev(w_qkv) / n, None, dev(cos), dev(sin), torch.tensor([5], device=DEVICE),
                       torch.tensor([1], device=DEVICE), cache[0], cache[1], heads, norm=(ss, 1e-5),
                       lora=(dev(lora_b), parts))
    xr = res + w @ a / k
    h = nw * xr * torch.rsqrt(xr.pow(2).mean() + 1e-5)
    y = w_qkv @ h / n + lora_b @ (lora_a @ h / n)
    qr = y[: heads * d].view(heads, d)
    _close(q, qr * cos[4] + _rotate_half(qr) * sin[4])


@pytest.mark.gpu
def test_cuda_8b_shapes_many_launches() -> None:
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    hidden, inter = 4096, 14336
    w_o = torch.randn(hidden, hidden, device=dev, dtype=bf) * hidden**-0.5
    w_gu = torch.randn(2 * inter, hidden, device=dev, dtype=bf) * hidden**-0.5
    a, res = torch.randn(hidden, device=dev, dtype=bf), torch.randn(hidden, device=dev, dtype=bf)
    nw = torch.rand(hidden, device=dev, dtype=bf) + 0.5
    xr = res.double() + w_o.double() @ a.double()
    hr = nw.double() * xr * torch.rsqrt(xr.pow(2).mean() + 1e-5)
    gate, up = w_gu[:inter].double() @ hr, w_gu[inter:].double() @ hr
    sums = torch.zeros(200, dtype=torch.float32, device=dev)
    outs = []
    for i in range(200):
        x, u = residual(a, w_o, res, nw, sums[i : i + 1])
        outs.append((x, glu(u, w_gu, inter, norm=(sums[i : i + 1], 1e-5))))
    torch.cuda.synchronize()
    for x, m in outs:
        _close(x, xr)
        _close(m, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_start_and_normed_head(dtype: torch.dtype, poisoned) -> None:
    """embed_start's (x, u, sums) then gemv's `norm` with float32 output = lm_head(RMSNorm(E[tok]))."""
    from kestrel.kernels.decode.gemv import gemv

    gen = torch.Generator().manual_seed(3)
    emb = torch.randn(11, 40, generator=gen, dtype=torch.float64)
    nw = torch.randn(40, generator=gen, dtype=torch.float64)
    head = torch.randn(13, 40, generator=gen, dtype=torch.float64) / 40**0.5
    sums = torch.full((7,), 5.0, dtype=torch.float32, device=DEVICE)
    dev = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    x, u = embed_start(torch.tensor([4], device=DEVICE), dev(emb), dev(nw), sums)
    _close(x, emb[4])
    _close(u, nw * emb[4])
    assert float(sums[0]) == pytest.approx(float(x.double().pow(2).sum()), rel=1e-5) and not sums[1:].any()
    logits = gemv(u, dev(head), norm=(sums[:1], 1e-6), out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    h = nw * emb[4] * torch.rsqrt(emb[4].pow(2).mean() + 1e-6)
    _close(logits.to(dtype), head @ h)


@pytest.mark.gpu
def test_cuda_8b_shapes_adapter_partial_sums_many_launches() -> None:
    """r = 16 adapters at the 8B shapes, back to back (programmatic dependent launches where the
    GPU has them): 14,336 glu programs adding into 16 slots, every launch's sums exact."""
    torch.manual_seed(1)
    dev, bf = "cuda", torch.bfloat16
    hidden, inter, r, slots, n = 4096, 14336, 16, 16, 100
    w_o = torch.randn(hidden, hidden, device=dev, dtype=bf) * hidden**-0.5
    w_gu = torch.randn(2 * inter, hidden, device=dev, dtype=bf) * hidden**-0.5
    a_gu, a_down = (torch.randn(r, k, device=dev, dtype=bf) * k**-0.5 for k in (hidden, inter))
    b_gu = torch.randn(2 * inter, r, device=dev, dtype=bf) * 0.1
    a, res = torch.randn(hidden, device=dev, dtype=bf), torch.randn(hidden, device=dev, dtype=bf)
    nw = torch.rand(hidden, device=dev, dtype=bf) + 0.5
    sums = torch.zeros(n, dtype=torch.float32, device=dev)
    parts = torch.zeros(n, 2, slots, r, dtype=torch.float32, device=dev)
    outs = []
    for i in range(n):
        x, u = residual(a, w_o, res, nw, sums[i : i + 1], ahead=(a_gu, parts[i, 0]))
        m = glu(u, w_gu, inter, norm=(sums[i : i + 1], 1e-5), lora=(b_gu, parts[i, 0]), ahead=(a_down, parts[i, 1]))
        outs.append((u, m))
    torch.cuda.synchronize()
    u0, m0 = outs[0]
    xr = res.double() + w_o.double() @ a.double()
    hr = nw.double() * xr * torch.rsqrt(xr.pow(2).mean() + 1e-5)
    gu = w_gu.double() @ hr + b_gu.double() @ (a_gu.double() @ hr)
    _close(m0, F.silu(gu[:inter]) * gu[inter:])
    for i, (u, m) in enumerate(outs):
        _close(parts[i, 0].sum(0), a_gu.double() @ u0.double())
        _close(parts[i, 1].sum(0), a_down.double() @ m.double())
        torch.testing.assert_close(m, m0, rtol=0, atol=float(m0.abs().max()) * 2e-2)
