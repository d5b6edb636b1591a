"""decode_attention (kernels/decode_attention.py) against its PyTorch reference computed in
float64: grouped-query heads, rows with different left padding, sliding windows, softcapping,
a head_dim that is no power of two, caches that are views of one larger buffer, enough keys for
several splits of several blocks each, attention sinks (gpt-oss), poisoned outputs and scratch,
and the per-head counters left at zero for the next launch. On CUDA the same checks run at the Llama-3.1-8B shape, many
launches in a row, to catch a merge that reads a split before it is written."""

from __future__ import annotations

import os

import pytest
import torch

from kestrel.kernels.decode.attention import decode_attention, decode_attention_reference, splits_for
from kestrel.model.attention import sink_softmax_attention

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if CUDA else "cpu"

# (batch, q heads, kv heads, cache length, head_dim, col, window, softcap)
CASES = [
    (1, 4, 2, 200, 32, 130, None, None),  # GQA, several one-block splits
    (3, 6, 2, 100, 24, 77, None, None),  # head_dim 24, three rows
    (2, 8, 8, 300, 64, 299, 50, None),  # plain MHA, the last column, a sliding window
    (2, 4, 1, 64, 16, 10, None, 30.0),  # softcapped scores, one KV head
    (4, 32, 16, 1000, 16, 700, None, None),  # 64 row-heads: splits of four blocks each
]


def _inputs(case, dtype: torch.dtype, seed: int = 0):
    b, nh, nkv, length, d, col, window, cap = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, d, generator=gen)
    # the caches as views of one (layers, 2, B, nkv, S, d) buffer, like StaticKVCache
    buf = torch.randn(3, 2, b, nkv, length, d, generator=gen)
    pad = torch.randint(0, max(1, col // 2), (b,), generator=gen)
    to = dict(device=DEVICE, dtype=dtype)
    buf = buf.to(**to)
    return q.to(**to), buf[1, 0], buf[1, 1], torch.tensor([col], device=DEVICE), pad.to(DEVICE), d**-0.5, window, cap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, dtype: torch.dtype, poisoned, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    q, k, v, col, pad, scale, window, cap = _inputs(case, dtype)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k, v, col, pad, scale, window, cap, counters=counters)
    ref = decode_attention_reference(q.double(), k.double(), v.double(), col, pad, scale, window, cap)
    assert out.dtype == dtype and out.shape == q.shape and not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    assert not counters.any(), "the merging programs must leave their counters at zero"


def test_reference_is_the_masked_softmax() -> None:
    """The reference itself, against a loop over rows and heads with the valid keys sliced out."""
    q, k, v, col, pad, scale, window, _ = _inputs((2, 4, 2, 40, 8, 30, 12, None), torch.float64)
    out = decode_attention_reference(q, k, v, col, pad, scale, window)
    for b in range(2):
        lo = max(int(pad[b]), 30 - 12 + 1)
        for h in range(4):
            keys, vals = k[b, h // 2, lo:31], v[b, h // 2, lo:31]
            want = torch.softmax(keys @ q[b, h] * scale, dim=0) @ vals
            torch.testing.assert_close(out[b, h], want)


SINK_CASES = [CASES[0], CASES[2], CASES[4]]  # GQA, a sliding window, splits of several blocks


def _sinks(nh: int, dtype: torch.dtype) -> torch.Tensor:
    # e^4 against ~100 keys of scores ~N(0, 1): the sink takes a real share of every softmax.
    return (4.0 + torch.randn(nh, generator=torch.Generator().manual_seed(5))).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SINK_CASES)
def test_sinks_match_reference(case, dtype: torch.dtype, poisoned, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sink joins the merge's normaliser: the kernel against the reference's explicit sink
    column, and differs from attention without sinks (so a kernel that ignores them fails)."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    q, k, v, col, pad, scale, window, cap = _inputs(case, dtype)
    sinks = _sinks(q.shape[1], dtype)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k, v, col, pad, scale, window, cap, counters=counters, sinks=sinks)
    ref = decode_attention_reference(q.double(), k.double(), v.double(), col, pad, scale, window, cap, sinks.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    plain = decode_attention_reference(q.double(), k.double(), v.double(), col, pad, scale, window, cap)
    assert (plain - ref).norm() > 0.1 * ref.norm()  # the sinks take a real share of the mass
    assert not counters.any()


def test_reference_sinks_are_the_training_paths_sink_softmax() -> None:
    """The decode reference with sinks against `sink_softmax_attention` (HF's eager gpt-oss math),
    one row at a time over its valid keys, the step's query the last of them."""
    b, nh, nkv, length, d, col, window = 2, 4, 2, 40, 8, 30, 12
    q, k, v, col_t, pad, scale, _, _ = _inputs((b, nh, nkv, length, d, col, window, None), torch.float64)
    sinks = _sinks(nh, torch.float64)
    out = decode_attention_reference(q, k, v, col_t, pad, scale, window, sinks=sinks)
    for row in range(b):
        lo = max(int(pad[row]), col - window + 1)
        keys = k[row, :, lo : col + 1].repeat_interleave(nh // nkv, 0)[None]  # (1, nh, L, d)
        vals = v[row, :, lo : col + 1].repeat_interleave(nh // nkv, 0)[None]
        allowed = torch.ones(1, keys.shape[2], dtype=torch.bool, device=DEVICE)  # the one query sees every key
        want = sink_softmax_attention(q[row][None, :, None], keys, vals, allowed, scale, sinks)  # (1, nh, 1, d)
        torch.testing.assert_close(out[row], want[0, :, 0])


def test_splits_cover_the_cache() -> None:
    for bh, length in [(1, 1), (8, 768), (8, 8192), (128, 4096), (512, 100)]:
        n, chunk = splits_for(bh, length)
        assert chunk % 64 == 0 and n * chunk >= length > (n - 1) * chunk


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16])
def test_cuda_8b_shape_many_launches(batch: int) -> None:
    torch.manual_seed(0)
    length, col = 768, 600
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, 8, length, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pad = torch.randint(0, 100, (batch,), device="cuda")
    col_t = torch.tensor([col], device="cuda")
    counters = torch.zeros(batch * 8, dtype=torch.int32, device="cuda")
    ref = decode_attention_reference(q.float(), k.float(), v.float(), col_t, pad, 128**-0.5)
    outs = [decode_attention(q, k, v, col_t, pad, 128**-0.5, counters=counters) for _ in range(200)]
    torch.cuda.synchronize()
    for out in outs:
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    assert not counters.any()
