"""The decode layer's fused products (kernels/gemv_fused.py) against plain PyTorch in float64:
RoPE'd q, the K/V cache writes (and nothing else of the cache touched), biases, GQA head
counts, SiLU and tanh-GELU gates, an intermediate size that is no multiple of any block, the
residual add with the RMSNorm split across launches (residual's u and sum of squares, finished
by the next product's `norm`), weights that are row slices of a larger buffer, and poisoned
outputs. On CUDA the 8B shapes run many times in a row."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels.gemv_fused import embed_start, glu, qkv_rope_cache, residual

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
    from kernels.gemv import gemv

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
