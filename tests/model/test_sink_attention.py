"""Attention sinks on the varlen path (gpt-oss), on a CPU.

`SinkAttention` runs on a pure-torch stand-in for flash's varlen forward (out and logsumexp) and
backward (the flash formula from q, k, v, out, logsumexp, grad_out), against autograd through
the explicit sink softmax. Then a tiny gpt-oss patched with the reference varlen path on packed
rows against the unpatched HF model (eager, its own masks) on the same samples one a row.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from kestrel.model import attention as attn
from kestrel.model.patching import PatchFlags, patch_model, runs_varlen
from kestrel.model.sink_attention import FlashKernels, sink_attention
from kestrel.recompute.checkpoint import set_gradient_checkpointing
from tests.support.compare import assert_same_trainable_grads
from tests.support.tiny import tiny_model
from tests.support.unpacked import two_layouts

VOCAB = 512


def _allowed(cu: torch.Tensor, n: int, window: tuple[int, int]) -> torch.Tensor:
    """(N, N) bool: query i may see key j (same sample, inside flash's (left, right) window)."""
    sample = torch.bucketize(torch.arange(n), cu[1:].long(), right=True)  # (N,) which sample each token is in
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = sample[:, None] == sample[None, :]
    left, right = window
    if left >= 0:
        allowed &= i - j <= left
    if right >= 0:
        allowed &= j - i <= right
    return allowed


def _scores(q: torch.Tensor, k: torch.Tensor, cu: torch.Tensor, scale: float, window: tuple[int, int]) -> torch.Tensor:
    """(Hq, N, N) masked scores in fp64; k's heads repeated as flash's GQA reads them."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.einsum("ihd,jhd->hij", q.double(), kk) * scale
    return s.masked_fill(~_allowed(cu, q.shape[0], window), float("-inf"))


def dense_forward(q, k, v, cu, max_len, scale, window):  # type: ignore[no-untyped-def]
    """Flash's varlen forward: out (N, Hq, D), logsumexp (Hq, N) in fp32 (fp64 for fp64 inputs)."""
    s = _scores(q, k, cu, scale, window)
    lse = s.logsumexp(-1)  # (Hq, N)
    vv = v.double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.einsum("hij,jhd->ihd", (s - lse[..., None]).exp(), vv)
    return out.to(q.dtype), lse.to(torch.promote_types(q.dtype, torch.float32))


def dense_backward(grad_out, q, k, v, out, lse, cu, max_len, scale, window):  # type: ignore[no-untyped-def]
    """Flash's backward: P = exp(S - lse), dV = P^T g, dP = g V^T, D = rowsum(g * out),
    dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q; dK, dV summed over each KV group."""
    groups = q.shape[1] // k.shape[1]
    p = (_scores(q, k, cu, scale, window) - lse.double()[..., None]).exp()  # (Hq, N, N)
    g, o = grad_out.double(), out.double()
    kk, vv = (x.double().repeat_interleave(groups, dim=1) for x in (k, v))
    dp = torch.einsum("ihd,jhd->hij", g, vv)
    ds = p * (dp - (g * o).sum(-1).t()[..., None])
    dq = torch.einsum("hij,jhd->ihd", ds, kk) * scale
    dk = torch.einsum("hij,ihd->jhd", ds, q.double()) * scale
    dv = torch.einsum("hij,ihd->jhd", p, g)
    fold = lambda x: x.reshape(x.shape[0], k.shape[1], groups, x.shape[-1]).sum(2)  # noqa: E731
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


STAND_IN = FlashKernels(dense_forward, dense_backward)


@pytest.mark.parametrize("window", [(-1, 0), (2, 0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sink_attention_matches_the_explicit_sink_softmax(window: tuple[int, int], dtype: torch.dtype) -> None:
    """Samples of 5, 0 (empty), 7 and 1 tokens, then capacity padding; 4 query heads on 2 KV heads."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 5, 12, 13, 13, 13], dtype=torch.int32)
    n, hq, hkv, d = 13, 4, 2, 8
    q, k, v = (torch.randn(n, h, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g, dtype=dtype) * 2  # some heads sink much of their mass, some little
    grad = torch.randn(n, hq, d, generator=g, dtype=dtype)
    scale = d**-0.5
    inputs = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    got = sink_attention(*inputs, cu, 7, scale, window, STAND_IN)
    got.backward(grad)
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    rq, rk, rv, rs = ref_inputs
    want = attn.reference_varlen_attn(rq, rk, rv, cu, cu, 7, 7, scale=scale, window_size=window, enable_gqa=True, sinks=rs)
    want.backward(grad)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    for name, a, b in zip(("dq", "dk", "dv", "d_sinks"), inputs, ref_inputs):
        torch.testing.assert_close(a.grad, b.grad, **tol, msg=name)
    assert rs.grad.abs().min() > 1e-3  # every sink's gradient is there to be checked


def test_sink_attention_skips_what_needs_no_gradient() -> None:
    """Frozen sinks (LoRA training): no d_sinks; frozen q, k, v: no flash backward at all."""
    calls = []

    def counting_backward(*args: Any) -> Any:
        calls.append(1)
        return dense_backward(*args)

    kernels = FlashKernels(dense_forward, counting_backward)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    q, k, v = (torch.randn(6, 2, 4) for _ in range(3))
    sinks = torch.zeros(2, requires_grad=True)
    sink_attention(q, k, v, sinks, cu, 3, 0.5, (-1, 0), kernels).sum().backward()
    assert calls == [] and sinks.grad is not None
    q.requires_grad_()
    frozen = torch.zeros(2)
    sink_attention(q, k, v, frozen, cu, 3, 0.5, (-1, 0), kernels).sum().backward()
    assert calls == [1] and frozen.grad is None and q.grad is not None


def _counting_reference(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each reference varlen call, True when it got sinks."""
    seen: list[bool] = []
    real = attn.reference_varlen_attn

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs.get("sinks") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(attn, "reference_varlen_attn", spy)
    return seen


@pytest.mark.parametrize("checkpointing", ["off", "standard", "offload"])
def test_packed_gpt_oss_matches_hf_on_the_samples_one_a_row(checkpointing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed rows (samples of 13 + 6 and 4 + 15 tokens; sliding window 6 on layer 0, full layer 1)
    through the reference varlen path with sinks, against HF's eager gpt-oss on the same samples
    one a row: logits of every real token, the summed loss, every parameter's gradient (sinks
    too), with the layers recomputed in the backward too (`kestrel.recompute`)."""
    seen = _counting_reference(monkeypatch)
    ref = tiny_model("gpt_oss", VOCAB, seed=3, sliding_window=6)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.normal_(0, 2)  # sinks that take a real share of the mass
    fast = copy.deepcopy(ref)
    patch_model(fast, PatchFlags(varlen="reference"))
    assert runs_varlen(fast)  # training lays batches out padding-free for it
    set_gradient_checkpointing(fast, checkpointing)
    data = two_layouts([[13, 6], [4, 15]], VOCAB, seed=4)
    ref.train(), fast.train()
    want = ref(**data.unpacked, num_items_in_batch=data.num_items)
    got = fast(**data.packed, num_items_in_batch=data.num_items, use_cache=False)
    assert seen and all(seen)  # every layer took the varlen path, with its sinks
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
    want.loss.backward()
    got.loss.backward()
    assert len(seen) == (2 if checkpointing == "off" else 4) and all(seen)  # a recompute per layer
    assert_same_trainable_grads(fast, ref, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        want_logits = ref(**{k: v for k, v in data.unpacked.items() if k != "labels"}).logits
        got_logits = fast(input_ids=data.packed["input_ids"], position_ids=data.packed["position_ids"], use_cache=False).logits
    torch.testing.assert_close(got_logits, want_logits[data.where], rtol=1e-4, atol=1e-4)
