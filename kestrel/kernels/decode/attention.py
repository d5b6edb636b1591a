"""Attention for a decode step: one query token per row against a static KV cache, one launch.

    q        (B, n_heads, d)            the step's queries, RoPE applied
    k_cache  (B, n_kv, S, d)            unit stride on d; any other strides (views of one buffer)
    v_cache  (B, n_kv, S, d)
    col      (1,) int64                 the step's cache column (already written)
    pad      (B,) int64                 left-padding columns per row
    sinks    (n_heads,) or None         attention sinks (gpt-oss): one more logit per head, value 0
    out      (B, n_heads, d)            softmax(q K^T * scale) V over the row's valid keys
                                        (with sinks: softmax over [scores, sink], the sink's share dropped)

Valid keys of row b: pad[b] <= j <= col, and j > col - window for sliding-window layers. Query
head h reads KV head h // (n_heads / n_kv) (grouped-query attention, as HF's `repeat_kv`).

Why a kernel: as matmul, softmax, matmul the step costs three launches a layer plus the score
tensor's round trip, far more fixed cost than the 1-3 MB of cache it reads (bench/RESULTS.md,
Decode "Session 3"). Here one launch reads K and V once, at any batch.

Split-S with the merge in the same launch (flash-decoding): the grid is (B * n_kv, n_splits);
each program keeps an online softmax over its share of the keys, and the last one of a KV head
to finish merges the partials (`_decode_attention_kernel`, `_merge`) and leaves the counters at
zero for the next launch or CUDA graph replay. A sink joins only the merge: it is one more term
e^(s_h - M) of the normaliser and adds nothing to the numerator.

The G query heads ride as the rows of one (BLOCK_G >= 16, d) tile so both products are
`tl.dot`s, on float32 operands: 16-bit q, K and V are exact in TF32, so TF32 products lose
nothing for them and keep the probabilities at TF32's 10 mantissa bits rather than bf16's 7
(float32 models get IEEE products). Loading 16-bit values as float32 also keeps Triton's CPU
interpreter, whose bf16 `tl.dot` is wrong, on the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kestrel.kernels._utils import pdl, pdl_launch
from kestrel.kernels.dispatch import use_triton
from kestrel.kernels.decode.gemv import pdl_start

_BLOCK_S = 64
_TARGET_PROGRAMS = 256  # enough CTAs to spread a ~1-3 MB cache read over a large GPU's SMs
_MERGE_ELEMENTS = 16384  # float32 partials one merging program loads at once (64 a thread)
_WARPS = 4


@triton.jit
def _decode_attention_kernel(
    Q, K, V, OUT, PART_O, PART_ML, COUNTER, COL, PAD, SINKS,
    q_sb, q_sh, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh,
    scale, softcap, window,
    N_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N_SPLITS: tl.constexpr, CHUNK: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SP: tl.constexpr, BLOCK_GM: tl.constexpr, PDL: tl.constexpr,
):
    """Program (bh, s) takes the G = n_heads / n_kv query heads that share KV head bh and keys
    [s * CHUNK, (s + 1) * CHUNK), and keeps an online softmax over BLOCK_S-key blocks:

        m' = max(m, max_j s_j)      l' = l e^(m - m') + sum_j e^(s_j - m')
        acc' = acc e^(m - m') + sum_j e^(s_j - m') v_j

    then writes (acc, m, l) of its G real heads to scratch and counts itself done on a per-bh
    counter. The last program of bh to finish merges all n_splits partials at once (`_merge`:
    one split at a time was latency-bound), then sets the counter back to zero, ready for the
    next launch (and the next replay of a captured CUDA graph). A split with no valid key leaves
    m = -inf, l = 0, acc = 0 and drops out of the merge. Ordering: every thread's partial stores
    come before a CTA barrier and an acq_rel atomic at GPU scope; the merging program reads the
    partials past L1 (`.cg`)."""
    pdl_start(PDL)
    if PDL:
        gdc_wait()  # q and the step's cache column come from the previous launch
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // N_KV
    hk = bh % N_KV
    col = tl.load(COL)
    lo = tl.load(PAD + b)
    if HAS_WINDOW:
        lo = tl.maximum(lo, col - window + 1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gd_ok = (g < G)[:, None] & (d < D)[None, :]
    q_rows = Q + b.to(tl.int64) * q_sb + (hk * G + g).to(tl.int64)[:, None] * q_sh
    q = tl.load(q_rows + d[None, :], mask=gd_ok, other=0.0).to(tl.float32)
    k_base = K + b.to(tl.int64) * k_sb + hk.to(tl.int64) * k_sh
    v_base = V + b.to(tl.int64) * v_sb + hk.to(tl.int64) * v_sh
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)  # noqa: E741 - the softmax's running sum, as flash attention names it
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    start = split * CHUNK
    for s0 in range(0, CHUNK, BLOCK_S):
        first = start + s0
        if (first <= col) & (first + BLOCK_S > lo):  # blocks wholly outside the valid keys: skip
            keys = first + tl.arange(0, BLOCK_S)
            ok = (keys >= lo) & (keys <= col)
            kt = tl.load(k_base + keys.to(tl.int64)[None, :] * k_ss + d[:, None],
                         mask=ok[None, :] & (d < D)[:, None], other=0.0).to(tl.float32)  # (BLOCK_D, BLOCK_S)
            # V's load issued with K's, before the first product: one memory round trip, not two
            v = tl.load(v_base + keys.to(tl.int64)[:, None] * v_ss + d[None, :],
                        mask=ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)  # (BLOCK_S, BLOCK_D)
            s = tl.dot(q, kt, input_precision=PRECISION) * scale  # (BLOCK_G, BLOCK_S)
            if HAS_SOFTCAP:
                s = softcap * _tanh(s / softcap)
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m = m_new
    part = (bh * N_SPLITS + split).to(tl.int64)
    g_ok = g < G
    tl.store(PART_O + (part * G + g)[:, None] * D + d[None, :], acc, mask=gd_ok)
    tl.store(PART_ML + (part * 2) * G + g, m, mask=g_ok)
    tl.store(PART_ML + (part * 2 + 1) * G + g, l, mask=g_ok)
    tl.debug_barrier()
    done = tl.atomic_add(COUNTER + bh, 1, sem="acq_rel", scope="gpu")
    if done == N_SPLITS - 1:
        _merge(PART_O, PART_ML, OUT + b.to(tl.int64) * o_sb + (hk * G).to(tl.int64) * o_sh, o_sh,
               SINKS + hk * G, bh, N_SPLITS, G, D, HAS_SINKS, BLOCK_SP, BLOCK_GM, BLOCK_D)
        tl.atomic_xchg(COUNTER + bh, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge(PART_O, PART_ML, OUT, o_sh, SINKS, bh, N_SPLITS: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
           HAS_SINKS: tl.constexpr, BLOCK_SP: tl.constexpr, BLOCK_GM: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[g] = sum_s acc_s[g] e^(m_s[g] - M) / (sum_s l_s[g] e^(m_s[g] - M) [+ e^(sink[g] - M)]),
    M = max(max_s m_s[g] [, sink[g]]), over the bh's splits, all loaded at once (one memory round
    trip, not one a split). SINKS points at the bh's first query head's sink."""
    s = tl.arange(0, BLOCK_SP)[:, None]
    g = tl.arange(0, BLOCK_GM)[None, :]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    sg_ok = (s < N_SPLITS) & (g < G)
    part = bh.to(tl.int64) * N_SPLITS + s  # (SP, 1)
    m_s = tl.load(PART_ML + (part * 2) * G + g, mask=sg_ok, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(PART_ML + (part * 2 + 1) * G + g, mask=sg_ok, other=0.0, cache_modifier=".cg")
    o_ok = sg_ok[:, :, None] & (d < D)
    o_s = tl.load(PART_O + ((part * G + g) * D)[:, :, None] + d, mask=o_ok, other=0.0, cache_modifier=".cg")
    big_m = tl.max(m_s, axis=0)  # (GM,): every real head has a valid key, so finite
    if HAS_SINKS:
        gm = tl.arange(0, BLOCK_GM)
        sink = tl.load(SINKS + gm, mask=gm < G, other=0.0).to(tl.float32)
        big_m = tl.maximum(big_m, sink)
        sink_mass = tl.exp(sink - big_m)  # the sink's share of the normaliser: value 0, nothing joins big_o
    else:
        sink_mass = tl.zeros((BLOCK_GM,), tl.float32)
    c = tl.exp(m_s - tl.where(big_m == float("-inf"), 0.0, big_m)[None, :])  # (SP, GM); 0 for empty splits
    big_l = tl.sum(l_s * c, axis=0) + sink_mass
    big_o = tl.sum(o_s * c[:, :, None], axis=0)  # (GM, D)
    out = big_o / tl.where(big_l == 0.0, 1.0, big_l)[:, None]
    gg = tl.arange(0, BLOCK_GM)[:, None]
    dd = tl.arange(0, BLOCK_D)[None, :]
    tl.store(OUT + gg.to(tl.int64) * o_sh + dd, out.to(OUT.dtype.element_ty), mask=(gg < G) & (dd < D))


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (e^(2x) + 1): finite for any x (e^(2x) overflowing gives 1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


def splits_for(batch_heads: int, length: int, merge_row: int = 512) -> tuple[int, int]:
    """(n_splits, chunk): keys per program a multiple of BLOCK_S, about _TARGET_PROGRAMS programs,
    and at most _MERGE_ELEMENTS / merge_row splits (the merge holds every split's (G, d) rows)."""
    blocks = triton.cdiv(length, _BLOCK_S)
    cap = max(1, _MERGE_ELEMENTS // merge_row)
    want = max(1, min(blocks, _TARGET_PROGRAMS // max(1, batch_heads), cap))
    chunk = _BLOCK_S * triton.cdiv(blocks, want)
    return triton.cdiv(length, chunk), chunk


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    col: torch.Tensor,
    pad: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    counters: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, nh, d), caches (B, nkv, S, d), col (1,), pad (B,), sinks (nh,) or None -> out (B, nh, d)
    in q's dtype.

    `counters`: an int32 tensor of at least B * nkv zeros, owned by the caller and reused across
    calls (each launch leaves it zero); None allocates one. The Triton kernel runs where
    `kestrel.kernels.dispatch` says so, else `decode_attention_reference`. No host synchronisation.
    """
    if not use_triton(q, k_cache, v_cache):
        return decode_attention_reference(q, k_cache, v_cache, col, pad, scale, window, softcap, sinks)
    b, nh, d = q.shape
    nkv, length = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("decode_attention needs caches with unit stride on head_dim")
    q = q if q.stride(2) == 1 else q.contiguous()
    if nh % nkv:
        raise ValueError(f"{nh} query heads do not group over {nkv} KV heads")
    group = nh // nkv
    block_g, block_d = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(d))
    n_splits, chunk = splits_for(b * nkv, length, triton.next_power_of_2(group) * block_d)
    out = torch.empty_like(q)
    part_o = torch.empty((b * nkv, n_splits, group, d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((b * nkv, n_splits, 2, group), dtype=torch.float32, device=q.device)
    if counters is None:
        counters = torch.zeros(b * nkv, dtype=torch.int32, device=q.device)
    elif counters.numel() < b * nkv or counters.dtype != torch.int32:
        raise ValueError(f"counters must be int32 with at least {b * nkv} elements")
    if sinks is not None and sinks.shape != (nh,):
        raise ValueError(f"sinks must have one logit per query head ({nh}), got shape {tuple(sinks.shape)}")
    _decode_attention_kernel[(b * nkv, n_splits)](
        q, k_cache, v_cache, out, part_o, part_ml, counters, col, pad, q if sinks is None else sinks,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(window or 0),
        N_KV=nkv, G=group, D=d, N_SPLITS=n_splits, CHUNK=chunk,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_S=_BLOCK_S, BLOCK_G=block_g, BLOCK_D=block_d,
        BLOCK_SP=triton.next_power_of_2(n_splits), BLOCK_GM=triton.next_power_of_2(group), num_warps=_WARPS,
        **pdl_launch(pdl(q.device)),
    )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    col: torch.Tensor,
    pad: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in plain PyTorch: scores in float32, probabilities in q's dtype; with
    `sinks` (nh,) a sink column joins each softmax and is dropped after it."""
    b, nh, d = q.shape
    nkv, length = k_cache.shape[1], k_cache.shape[2]
    keys = torch.arange(length, device=q.device)[None]  # (1, S)
    valid = (keys >= pad[:, None]) & (keys <= col)  # (B, S)
    if window is not None:
        valid = valid & (keys > col - window)
    qg = q.reshape(b, nkv, nh // nkv, d)
    scores = torch.matmul(qg, k_cache.transpose(-1, -2)).float() * scale  # (B, nkv, G, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    if sinks is None:
        probs = F.softmax(scores, dim=-1)
    else:
        sink = sinks.float().reshape(1, nkv, nh // nkv, 1).expand(b, -1, -1, 1)  # (B, nkv, G, 1)
        probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs.to(q.dtype), v_cache)  # (B, nkv, G, d)
    return out.reshape(b, nh, d)
