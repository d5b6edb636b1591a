"""Matrix-vector products with a decode layer's small ops folded into their epilogues.

At batch 1 a Llama-style layer is four products (q/k/v, o, gate/up, down) and, between them,
RoPE, the cache write, the residual adds, two RMSNorms and SiLU(gate) * up: one small kernel
each, whose launch and tail are a large share of a product's own time at batch 1
(bench/RESULTS.md, Decode "Session 3"). Computing the small ops on the INPUT side of a product
was tried and rejected (`gemv.py`: every program re-reads the vectors). These kernels do them on
the OUTPUT side, where each program holds finished output rows:

`qkv_rope_cache`: y = W_qkv h (+ b). Program p owns the row pair (j, j + d/2) of one head, the
    two halves RoPE mixes, so it rotates them in registers:
        y1' = y1 c1 - y2 s1     y2' = y2 c2 + y1 s2     (c, s: the row of the position pos)
    and stores q heads to `q_out` (n_heads, d), k heads (rotated) and v heads to cache column
    `col` of their KV head. pos = col - pad.
`glu`: out = act(W_gate h) * (W_up h); program p owns gate row i and up row i (the up rows
    start `inter` rows after the gate rows in one buffer).
`residual`: x' = res + W a, the residual add, and the first half of the next RMSNorm:
        u = w * x'     ss += sum(x'^2)       (one float32 atomic add a program)
    The next product finishes it: with r = rsqrt(ss / N + eps), W' (w * x' r) = r (W' u), so
    `qkv_rope_cache` and `glu` take `norm=(ss, eps)` and scale their float32 sums by r. A norm
    needs the whole of x' and no program has it; this moves that reduction across the launch
    boundary instead of into a kernel of its own. The caller zeroes the sums once per step.

An unmerged adapter's shrink t = A h is split the same way (`ahead` on the launch that writes h:
each program adds A[:, its rows] h[its rows] into float32 partial sums over a few slots; `lora` on
the consumer: t = rsqrt(...) * sum of the slots, then B t joins its rows). On Hopper and later
every launch here is a programmatic dependent one (`kestrel.kernels._utils.pdl`): the weights' first tile
and B's rows are loaded before waiting for the previous launch, everything it wrote after.

All products accumulate in float32 and round once, so results agree with the unfused path to the
dtype's rounding, not bit for bit. No host synchronisation: `col` and `pad` are device tensors.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kestrel.kernels._utils import cdiv, interpreted, next_pow2, pdl, pdl_launch
from kestrel.kernels.decode.gemv import dot_rows, k_launch, pdl_start, rstd_from

# Rows per program and columns per step: the fastest in a sweep at the 8B shapes, each close to
# the plain gemv of its shape (`bench/decode_kernels.py`; bench/RESULTS.md, Decode "Session 3").
# Fewer, fatter programs starve the memory system at 2 warps (no variant spilled registers).
_BLOCK_K, _WARPS = 1024, 2
_PAIR_ROWS = 1  # (j, j + d/2) pairs, (gate, up) pairs: 2 rows a program
_RESIDUAL_ROWS = 4
_ZERO_BLOCK = 4096  # float32 values an `embed_start` program zeroes


def _pair_rows(n: int) -> int:
    """Row pairs a program takes: _PAIR_ROWS (32 interpreted), halved until it divides n."""
    block_p = 32 if interpreted() else _PAIR_ROWS
    while n % block_p:
        block_p //= 2
    return block_p


@triton.jit
def _dot_pair(X, W, row_a, row_b, stride_w, K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
              PDL: tl.constexpr):
    """(W[row_a + i] @ x, W[row_b + i] @ x) for i < BLOCK_P, each (BLOCK_P,) float32.

    One (2 BLOCK_P, BLOCK_K) tile, rows a then b: a (1, BLOCK_K) tile per row set would let
    the warps of a program load the same row twice."""
    idx = tl.arange(0, 2 * BLOCK_P)
    rows = tl.where(idx < BLOCK_P, row_a + idx, row_b + idx - BLOCK_P)
    y = dot_rows(X, W, rows, idx >= 0, stride_w, K, 2 * BLOCK_P, BLOCK_K, PDL)
    y2 = tl.reshape(y, (2, BLOCK_P))
    first = (tl.arange(0, 2) == 0)[:, None]
    return tl.sum(tl.where(first, y2, 0.0), axis=0), tl.sum(tl.where(first, 0.0, y2), axis=0)


@triton.jit
def _lora_b(LB, stride_b, rows, R: tl.constexpr, BLOCK_R: tl.constexpr):
    """(len(rows), BLOCK_R) float32: rows of an unmerged adapter's B (pre-scaled). B never
    changes within a step, so kernels load it before waiting for the previous launch."""
    r = tl.arange(0, BLOCK_R)
    b = tl.load(LB + rows.to(tl.int64)[:, None] * stride_b + r[None, :], mask=(r < R)[None, :], other=0.0)
    return b.to(tl.float32)


@triton.jit
def _lora_t(LT, stride_t, scale, R: tl.constexpr, BLOCK_R: tl.constexpr, SLOTS: tl.constexpr, DTYPE: tl.constexpr):
    """(BLOCK_R,) float32: the adapter's low-rank input t = scale * sum_s T[s] (T: SLOTS partial
    sums of A h, from the launch that produced h, see `_ahead_add`; scale: the input norm's
    rsqrt, as the product's), rounded to the model dtype like a product's output."""
    s = tl.arange(0, SLOTS)[:, None]
    r = tl.arange(0, BLOCK_R)[None, :]
    t = tl.sum(tl.load(LT + s * stride_t + r, mask=(r < R) & (s >= 0), other=0.0), axis=0)
    return (t * scale).to(DTYPE).to(tl.float32)


@triton.jit
def _ahead_a(LA, stride_a, idx, ok, R: tl.constexpr, BLOCK_R: tl.constexpr):
    """(BLOCK_R, len(idx)) float32: columns idx of the NEXT product's adapter A (r, K')."""
    r = tl.arange(0, BLOCK_R)
    a = tl.load(LA + r.to(tl.int64)[:, None] * stride_a + idx[None, :], mask=(r < R)[:, None] & ok[None, :],
                other=0.0)
    return a.to(tl.float32)


@triton.jit
def _ahead_add(T, stride_t, a, h, R: tl.constexpr, BLOCK_R: tl.constexpr, SLOTS: tl.constexpr):
    """T[slot] += a @ h: this program's share of the next product's shrink t = A h, where h is
    the slice of that product's input this program just wrote. Programs spread over SLOTS rows
    of T (each its own cache line) so the atomics do not all queue on one address."""
    r = tl.arange(0, BLOCK_R)
    part = tl.sum(a * h[None, :], axis=1)
    slot = tl.program_id(0) % SLOTS
    tl.atomic_add(T + slot * stride_t + r, part, mask=r < R, sem="relaxed", scope="gpu")


@triton.jit
def _qkv_rope_cache_kernel(
    X, W, BIAS, Q_OUT, K_CACHE, V_CACHE, COS, SIN, COL, PAD, SS, LB, LT,
    stride_w, k_sh, k_ss, v_sh, v_ss, cos_ss, eps, stride_b, stride_t,
    N_HEADS: tl.constexpr, N_KV: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, SLOTS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    half: tl.constexpr = D // 2
    per_head: tl.constexpr = half // BLOCK_P
    pid = tl.program_id(0)
    head = pid // per_head
    j0 = (pid % per_head) * BLOCK_P
    j = j0 + tl.arange(0, BLOCK_P)
    if R > 0:
        b1 = _lora_b(LB, stride_b, head * D + j, R, BLOCK_R)
        b2 = _lora_b(LB, stride_b, head * D + half + j, R, BLOCK_R)
    y1, y2 = _dot_pair(X, W, head * D + j0, head * D + half + j0, stride_w, K, BLOCK_P, BLOCK_K, PDL)
    rstd = rstd_from(SS, eps, K, HAS_NORM)
    if R > 0:
        t = _lora_t(LT, stride_t, rstd, R, BLOCK_R, SLOTS, Q_OUT.dtype.element_ty)
    y1, y2 = y1 * rstd, y2 * rstd
    if HAS_BIAS:
        y1 += tl.load(BIAS + head * D + j).to(tl.float32)
        y2 += tl.load(BIAS + head * D + half + j).to(tl.float32)
    if R > 0:
        y1 += tl.sum(b1 * t[None, :], axis=1)
        y2 += tl.sum(b2 * t[None, :], axis=1)
    col = tl.load(COL)
    if head < N_HEADS + N_KV:  # q or k: rotate
        cs = (col - tl.load(PAD)).to(tl.int64) * cos_ss
        c1 = tl.load(COS + cs + j).to(tl.float32)
        c2 = tl.load(COS + cs + half + j).to(tl.float32)
        s1 = tl.load(SIN + cs + j).to(tl.float32)
        s2 = tl.load(SIN + cs + half + j).to(tl.float32)
        y1, y2 = y1 * c1 - y2 * s1, y2 * c2 + y1 * s2
    if head < N_HEADS:
        out = Q_OUT + head * D
    elif head < N_HEADS + N_KV:
        out = K_CACHE + (head - N_HEADS).to(tl.int64) * k_sh + col * k_ss
    else:
        out = V_CACHE + (head - N_HEADS - N_KV).to(tl.int64) * v_sh + col * v_ss
    tl.store(out + j, y1.to(Q_OUT.dtype.element_ty))
    tl.store(out + half + j, y2.to(Q_OUT.dtype.element_ty))


@triton.jit
def _glu_kernel(
    X, W, OUT, SS, LB, LT, LA, TA, stride_w, eps, stride_b, stride_t, stride_a, stride_ta,
    INTER: tl.constexpr, K: tl.constexpr, GELU: tl.constexpr, HAS_NORM: tl.constexpr,
    R: tl.constexpr, BLOCK_R: tl.constexpr, SLOTS: tl.constexpr,
    RA: tl.constexpr, BLOCK_RA: tl.constexpr, SLOTS_A: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    first = tl.program_id(0) * BLOCK_P  # BLOCK_P divides INTER
    rows = first + tl.arange(0, BLOCK_P)
    if R > 0:
        b_gate = _lora_b(LB, stride_b, rows, R, BLOCK_R)
        b_up = _lora_b(LB, stride_b, rows + INTER, R, BLOCK_R)
    if RA > 0:
        a_next = _ahead_a(LA, stride_a, rows, rows < INTER, RA, BLOCK_RA)
    gate, up = _dot_pair(X, W, first, first + INTER, stride_w, K, BLOCK_P, BLOCK_K, PDL)
    rstd = rstd_from(SS, eps, K, HAS_NORM)
    gate, up = gate * rstd, up * rstd
    if R > 0:
        t = _lora_t(LT, stride_t, rstd, R, BLOCK_R, SLOTS, OUT.dtype.element_ty)
        gate += tl.sum(b_gate * t[None, :], axis=1)
        up += tl.sum(b_up * t[None, :], axis=1)
    if GELU:  # tanh approximation: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    m = (act * up).to(OUT.dtype.element_ty)
    tl.store(OUT + rows, m)
    if RA > 0:
        _ahead_add(TA, stride_ta, a_next, m.to(tl.float32), RA, BLOCK_RA, SLOTS_A)


@triton.jit
def _residual_kernel(
    A, W, RES, X_OUT, NORM_W, U_OUT, SS, LB, LT, LA, TA, stride_w, stride_b, stride_t, stride_a, stride_ta,
    N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, SLOTS: tl.constexpr,
    RA: tl.constexpr, BLOCK_RA: tl.constexpr, SLOTS_A: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    if R > 0:
        b = _lora_b(LB, stride_b, tl.where(ok, rows, 0), R, BLOCK_R)
    if RA > 0:
        a_next = _ahead_a(LA, stride_a, rows, ok, RA, BLOCK_RA)
    w = tl.load(NORM_W + rows, mask=ok, other=0.0).to(tl.float32)
    y = dot_rows(A, W, rows, ok, stride_w, K, BLOCK_N, BLOCK_K, PDL)
    if R > 0:
        y += tl.sum(b * _lora_t(LT, stride_t, 1.0, R, BLOCK_R, SLOTS, X_OUT.dtype.element_ty)[None, :], axis=1)
    y = y.to(X_OUT.dtype.element_ty).to(tl.float32)  # the product's own rounding, as unfused
    x = (tl.load(RES + rows, mask=ok, other=0.0).to(tl.float32) + y).to(X_OUT.dtype.element_ty)
    tl.store(X_OUT + rows, x, mask=ok)
    xf = tl.where(ok, x.to(tl.float32), 0.0)  # rows past N hold B's row 0 terms: kept out of the sum
    u = (w * xf).to(U_OUT.dtype.element_ty)
    tl.store(U_OUT + rows, u, mask=ok)
    tl.atomic_add(SS, tl.sum(xf * xf, axis=0), sem="relaxed", scope="gpu")
    if RA > 0:
        _ahead_add(TA, stride_ta, a_next, u.to(tl.float32), RA, BLOCK_RA, SLOTS_A)


@triton.jit
def _embed_start_kernel(
    TOK, EMBED, NORM_W, X_OUT, U_OUT, SUMS, ZERO, stride_e, N: tl.constexpr, N_SUMS: tl.constexpr,
    N_ZERO: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SUMS: tl.constexpr, BLOCK_ZERO: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    if PDL:
        gdc_wait()  # the token comes from the previous launch
    pid = tl.program_id(0)
    if pid > 0:  # the other programs zero the adapters' partial sums
        z = (pid - 1) * BLOCK_ZERO + tl.arange(0, BLOCK_ZERO)
        tl.store(ZERO + z, tl.zeros((BLOCK_ZERO,), tl.float32), mask=z < N_ZERO)
    else:
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(EMBED + tl.load(TOK).to(tl.int64) * stride_e + cols, mask=ok, other=0.0)
        tl.store(X_OUT + cols, x, mask=ok)
        xf = x.to(tl.float32)
        w = tl.load(NORM_W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(U_OUT + cols, (w * xf).to(U_OUT.dtype.element_ty), mask=ok)
        slots = tl.arange(0, BLOCK_SUMS)
        first = tl.sum(xf * xf, axis=0)
        tl.store(SUMS + slots, tl.where(slots == 0, first, 0.0), mask=slots < N_SUMS)


def embed_start(
    tok: torch.Tensor,
    embed: torch.Tensor,
    norm_weight: torch.Tensor,
    sums: torch.Tensor,
    zero: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """tok (1,) int64; embed (V, N); norm_weight (N,); sums (S,) float32 -> x = embed[tok] and
    u = norm_weight * x, each (N,), with sums[0] = sum(x^2) and every other slot zeroed: the
    step's start in one launch (the first RMSNorm begun, the step's sums ready for `residual`).
    zero: a float32 tensor more to zero in the same launch (the adapters' partial sums)."""
    n = embed.shape[1]
    x = torch.empty(n, dtype=embed.dtype, device=embed.device)
    u = torch.empty_like(x)
    n_zero = 0 if zero is None else zero.numel()
    _embed_start_kernel[(1 + cdiv(n_zero, _ZERO_BLOCK),)](
        tok, embed, norm_weight, x, u, sums, sums if zero is None else zero, embed.stride(0), N=n,
        N_SUMS=sums.numel(), N_ZERO=n_zero, BLOCK=next_pow2(n), BLOCK_SUMS=next_pow2(sums.numel()),
        BLOCK_ZERO=_ZERO_BLOCK, num_warps=4, **pdl_launch(pdl(embed.device)),
    )
    return x, u


def _norm_args(norm: tuple[torch.Tensor, float] | None, like: torch.Tensor) -> tuple[torch.Tensor, float]:
    return (like, 0.0) if norm is None else norm


def _partials(t: torch.Tensor, r: int) -> tuple[int, int]:
    """(slots, row stride) of an adapter's partial sums: (slots, >= r) float32, or (r,) as one slot."""
    if t.dtype != torch.float32 or t.stride(-1) != 1 or t.shape[-1] < r:
        raise ValueError(f"adapter partial sums {tuple(t.shape)} {t.dtype}: need float32 (slots, >= {r})")
    return (1, r) if t.dim() == 1 else (t.shape[0], t.stride(0))


def _lora_args(lora: tuple[torch.Tensor, torch.Tensor] | None, like: torch.Tensor) -> dict:
    """The consumer side of an unmerged adapter: kernel arguments for `lora` = (B, T); R = 0 (and
    placeholders never read) without one."""
    if lora is None:
        return {"LB": like, "LT": like, "stride_b": 0, "stride_t": 0, "R": 0, "BLOCK_R": 1, "SLOTS": 1}
    b, t = lora
    r = b.shape[1]
    if b.stride(1) != 1:
        raise ValueError(f"adapter B {tuple(b.shape)} needs unit column stride")
    slots, stride_t = _partials(t, r)
    return {"LB": b, "LT": t, "stride_b": b.stride(0), "stride_t": stride_t, "R": r, "BLOCK_R": next_pow2(r),
            "SLOTS": slots}


def _ahead_args(ahead: tuple[torch.Tensor, torch.Tensor] | None, like: torch.Tensor, n: int) -> dict:
    """The producer side: kernel arguments for `ahead` = (A, T) of the next product's adapter."""
    if ahead is None:
        return {"LA": like, "TA": like, "stride_a": 0, "stride_ta": 0, "RA": 0, "BLOCK_RA": 1, "SLOTS_A": 1}
    a, t = ahead
    r = a.shape[0]
    if a.dim() != 2 or a.shape[1] != n or a.stride(1) != 1 or t.dim() != 2:
        raise ValueError(f"next adapter A {tuple(a.shape)} (unit column stride) does not read {n} values")
    slots, stride_t = _partials(t, r)
    return {"LA": a, "TA": t, "stride_a": a.stride(0), "stride_ta": stride_t, "RA": r, "BLOCK_RA": next_pow2(r),
            "SLOTS_A": slots}


def qkv_rope_cache(
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    col: torch.Tensor,
    pad: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_heads: int,
    norm: tuple[torch.Tensor, float] | None = None,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """u (K,) one row; weight ((n_heads + 2 n_kv) d, K) rows q|k|v; cos, sin (S, d);
    col (1,), pad (1,) int64; k_cache, v_cache (1, n_kv, S, d) -> q (n_heads, d), RoPE applied.
    K and V of the step land in cache column col (K rotated). `norm` = (ss, eps): the input is
    w * x of an RMSNorm whose sum of squares ss ((1,) float32) `residual` accumulated, and the
    product is scaled by rsqrt(ss / K + eps) before the bias. `lora` = (B, T): an unmerged
    adapter, B (rows, r) pre-scaled, T float32 partial sums of its shrink A u, (slots, >= r)
    from the launch that wrote u (`ahead`), or (r,); t = rsqrt(...) sum_s T[s] and row n gains
    sum_r B[n, r] t[r] before RoPE."""
    n_kv, d = k_cache.shape[1], k_cache.shape[3]
    k = weight.shape[1]
    if weight.shape[0] != (n_heads + 2 * n_kv) * d or d % 2 or u.numel() != k:
        raise ValueError(f"q/k/v weight {tuple(weight.shape)} does not match {n_heads}+2x{n_kv} heads of {d}")
    q = torch.empty((n_heads, d), dtype=u.dtype, device=u.device)
    half = d // 2
    block_p = _pair_rows(half)
    ss, eps = _norm_args(norm, u)
    _qkv_rope_cache_kernel[((n_heads + 2 * n_kv) * (half // block_p),)](
        u, weight, weight if bias is None else bias, q, k_cache, v_cache, cos, sin, col, pad, ss,
        stride_w=weight.stride(0), k_sh=k_cache.stride(1), k_ss=k_cache.stride(2), v_sh=v_cache.stride(1),
        v_ss=v_cache.stride(2), cos_ss=cos.stride(0), eps=float(eps), N_HEADS=n_heads, N_KV=n_kv, D=d, K=k,
        HAS_BIAS=bias is not None, HAS_NORM=norm is not None, BLOCK_P=block_p, num_warps=_WARPS,
        **_lora_args(lora, u), **k_launch(k, _BLOCK_K, u.device),
    )
    return q


def glu(
    u: torch.Tensor,
    weight: torch.Tensor,
    inter: int,
    gelu: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
    ahead: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """u (K,) one row; weight (>= 2 inter, K) rows gate | up -> m = act(gate) * up, (inter,).
    act: SiLU, or tanh-approximate GELU with `gelu`; `norm`, `lora` (B with 2 inter rows) as in
    `qkv_rope_cache`. `ahead` = (A, T): the next product's adapter A (r, inter) and its partial
    sums T (slots, >= r) float32, zero before the launch: T gains A m over its slots."""
    k = weight.shape[1]
    out = torch.empty(inter, dtype=u.dtype, device=u.device)
    block_p = _pair_rows(inter)
    ss, eps = _norm_args(norm, u)
    _glu_kernel[(cdiv(inter, block_p),)](
        u, weight, out, ss, stride_w=weight.stride(0), eps=float(eps), INTER=inter, K=k, GELU=gelu,
        HAS_NORM=norm is not None, BLOCK_P=block_p, num_warps=_WARPS,
        **_lora_args(lora, u), **_ahead_args(ahead, u, inter), **k_launch(k, _BLOCK_K, u.device),
    )
    return out


def residual(
    a: torch.Tensor,
    weight: torch.Tensor,
    res: torch.Tensor,
    norm_weight: torch.Tensor,
    ss: torch.Tensor,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
    ahead: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a (K,) one row; weight (N, K); res, norm_weight (N,); ss (1,) float32, zero before the
    launch -> x' = res + W a and u = norm_weight * x', each (N,); ss += sum(x'^2).
    The next product finishes the RMSNorm: rsqrt(ss / N + eps) W' u = W' RMSNorm(x').
    `lora` as in `qkv_rope_cache` (unscaled: added to W a before the residual); `ahead` as in
    `glu`, of u: the next product's t is then rsqrt(ss / N + eps) sum_s T[s]."""
    n, k = weight.shape
    x = torch.empty(n, dtype=res.dtype, device=res.device)
    u = torch.empty_like(x)
    block_n = 32 if interpreted() else _RESIDUAL_ROWS
    _residual_kernel[(cdiv(n, block_n),)](
        a, weight, res, x, norm_weight, u, ss, stride_w=weight.stride(0), N=n, K=k, BLOCK_N=block_n,
        num_warps=_WARPS, **_lora_args(lora, a), **_ahead_args(ahead, a, n), **k_launch(k, _BLOCK_K, a.device),
    )
    return x, u
