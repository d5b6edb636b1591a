"""Matrix-vector products with a decode layer's small ops folded into their epilogues.

At batch 1 a Llama-style layer is four products (q/k/v, o, gate/up, down) and, between them,
RoPE, the cache write, the residual adds, two RMSNorms and SiLU(gate) * up: one small kernel
each, a few microseconds apiece of launch and tail on an H100/H200 against ~10-55 us per product
(bench/RESULTS.md). Computing the small ops on the INPUT side of a product was measured and
rejected (`gemv.py`: every program re-reads the vectors). These kernels do them on the OUTPUT
side, where each program holds finished output rows:

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

All products accumulate in float32 and round once (the unfused path rounds the product, then
each small op, to the model dtype: results agree to the dtype's rounding, not bit for bit).
Inputs: one row, contiguous; weights (N, K) with unit column stride (row slices of a fused buffer
are fine). No host synchronisation: `col` and `pad` are device tensors.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from kernels.gemv import dot_rows, interpreted, k_launch, rstd_from

# Rows per program and columns per step, from `bench/decode_kernels.py` on an H200 (8B shapes,
# us per launch; the plain gemv: q/k/v 13.4, o 9.7, gate/up 53.6, down 28.6):
#   qkv_rope_cache  2 rows x 2048: 17.4   2 x 1024: 15.0   4 x 1024: 15.0   8 x 512: 16.5
#   glu             2 rows x 2048: 61.9   2 x 1024: 54.1   4 x 1024: 55.6   8 x 512: 62.1
#   residual o      2 x 2048: 10.7   4 x 1024: 10.1   8 x 512: 29.0   16 x 256: 23.2
#   residual down   2 x 2048: 35.7   4 x 1024: 29.1   8 x 512: 93.3   16 x 256: 78.2
# (fewer, fatter programs starve the memory system at 2 warps; no variant spilled registers).
_BLOCK_K, _WARPS = 1024, 2
_PAIR_ROWS = 1  # (j, j + d/2) pairs, (gate, up) pairs: 2 rows a program
_RESIDUAL_ROWS = 4


def _pair_rows(n: int) -> int:
    """Row pairs a program takes: _PAIR_ROWS (32 interpreted), halved until it divides n."""
    block_p = 32 if interpreted() else _PAIR_ROWS
    while n % block_p:
        block_p //= 2
    return block_p


@triton.jit
def _dot_pair(X, W, row_a, row_b, stride_w, K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):
    """(W[row_a + i] @ x, W[row_b + i] @ x) for i < BLOCK_P, each (BLOCK_P,) float32.

    One (2 BLOCK_P, BLOCK_K) tile, rows a then b: a (1, BLOCK_K) tile per row set would let
    the warps of a program load the same row twice."""
    idx = tl.arange(0, 2 * BLOCK_P)
    rows = tl.where(idx < BLOCK_P, row_a + idx, row_b + idx - BLOCK_P)
    y = dot_rows(X, W, rows, idx >= 0, stride_w, K, 2 * BLOCK_P, BLOCK_K)
    y2 = tl.reshape(y, (2, BLOCK_P))
    first = (tl.arange(0, 2) == 0)[:, None]
    return tl.sum(tl.where(first, y2, 0.0), axis=0), tl.sum(tl.where(first, 0.0, y2), axis=0)


@triton.jit
def _lora_delta(LB, stride_b, LT, rows, R: tl.constexpr, BLOCK_R: tl.constexpr):
    """(len(rows),) float32: sum_r B[rows, r] t[r], an unmerged adapter's update of those rows."""
    r = tl.arange(0, BLOCK_R)
    t = tl.load(LT + r, mask=r < R, other=0.0).to(tl.float32)
    b = tl.load(LB + rows.to(tl.int64)[:, None] * stride_b + r[None, :], mask=(r < R)[None, :], other=0.0)
    return tl.sum(b.to(tl.float32) * t[None, :], axis=1)


@triton.jit
def _qkv_rope_cache_kernel(
    X, W, BIAS, Q_OUT, K_CACHE, V_CACHE, COS, SIN, COL, PAD, SS, LB, LT,
    stride_w, k_sh, k_ss, v_sh, v_ss, cos_ss, eps, stride_b,
    N_HEADS: tl.constexpr, N_KV: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
):
    half: tl.constexpr = D // 2
    per_head: tl.constexpr = half // BLOCK_P
    pid = tl.program_id(0)
    head = pid // per_head
    j0 = (pid % per_head) * BLOCK_P
    j = j0 + tl.arange(0, BLOCK_P)
    y1, y2 = _dot_pair(X, W, head * D + j0, head * D + half + j0, stride_w, K, BLOCK_P, BLOCK_K)
    rstd = rstd_from(SS, eps, K, HAS_NORM)
    y1, y2 = y1 * rstd, y2 * rstd
    if HAS_BIAS:
        y1 += tl.load(BIAS + head * D + j).to(tl.float32)
        y2 += tl.load(BIAS + head * D + half + j).to(tl.float32)
    if R > 0:
        y1 += _lora_delta(LB, stride_b, LT, head * D + j, R, BLOCK_R)
        y2 += _lora_delta(LB, stride_b, LT, head * D + half + j, R, BLOCK_R)
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
    X, W, OUT, SS, LB, LT, stride_w, eps, stride_b, INTER: tl.constexpr, K: tl.constexpr,
    GELU: tl.constexpr, HAS_NORM: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_P  # BLOCK_P divides INTER
    gate, up = _dot_pair(X, W, first, first + INTER, stride_w, K, BLOCK_P, BLOCK_K)
    rstd = rstd_from(SS, eps, K, HAS_NORM)
    gate, up = gate * rstd, up * rstd
    if R > 0:
        rows = first + tl.arange(0, BLOCK_P)
        gate += _lora_delta(LB, stride_b, LT, rows, R, BLOCK_R)
        up += _lora_delta(LB, stride_b, LT, rows + INTER, R, BLOCK_R)
    if GELU:  # tanh approximation: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(OUT + first + tl.arange(0, BLOCK_P), (act * up).to(OUT.dtype.element_ty))


@triton.jit
def _residual_kernel(
    A, W, RES, X_OUT, NORM_W, U_OUT, SS, LB, LT, stride_w, stride_b,
    N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    y = dot_rows(A, W, rows, ok, stride_w, K, BLOCK_N, BLOCK_K)
    if R > 0:
        y += _lora_delta(LB, stride_b, LT, tl.where(ok, rows, 0), R, BLOCK_R)
    y = y.to(X_OUT.dtype.element_ty).to(tl.float32)  # the product's own rounding, as unfused
    x = (tl.load(RES + rows, mask=ok, other=0.0).to(tl.float32) + y).to(X_OUT.dtype.element_ty)
    tl.store(X_OUT + rows, x, mask=ok)
    xf = x.to(tl.float32)
    w = tl.load(NORM_W + rows, mask=ok, other=0.0).to(tl.float32)
    tl.store(U_OUT + rows, (w * xf).to(U_OUT.dtype.element_ty), mask=ok)
    tl.atomic_add(SS, tl.sum(xf * xf, axis=0), sem="relaxed", scope="gpu")


@triton.jit
def _embed_start_kernel(
    TOK, EMBED, NORM_W, X_OUT, U_OUT, SUMS, stride_e, N: tl.constexpr, N_SUMS: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_SUMS: tl.constexpr,
):
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
    tok: torch.Tensor, embed: torch.Tensor, norm_weight: torch.Tensor, sums: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """tok (1,) int64; embed (V, N); norm_weight (N,); sums (S,) float32 -> x = embed[tok] and
    u = norm_weight * x, each (N,), with sums[0] = sum(x^2) and every other slot zeroed: the
    step's start in one launch (the first RMSNorm begun, the step's sums ready for `residual`)."""
    n = embed.shape[1]
    x = torch.empty(n, dtype=embed.dtype, device=embed.device)
    u = torch.empty_like(x)
    _embed_start_kernel[(1,)](
        tok, embed, norm_weight, x, u, sums, embed.stride(0), N=n, N_SUMS=sums.numel(),
        BLOCK=triton.next_power_of_2(n), BLOCK_SUMS=triton.next_power_of_2(sums.numel()), num_warps=4,
    )
    return x, u


def _norm_args(norm: tuple[torch.Tensor, float] | None, like: torch.Tensor) -> tuple[torch.Tensor, float]:
    return (like, 0.0) if norm is None else norm


def _lora_args(lora: tuple[torch.Tensor, torch.Tensor] | None, like: torch.Tensor) -> tuple:
    """(B, t, stride_b, R, BLOCK_R) for the kernels; R = 0 (placeholders never read) without one."""
    if lora is None:
        return like, like, 0, 0, 1
    b, t = lora
    r = t.numel()
    if b.stride(1) != 1 or b.shape[1] != r:
        raise ValueError(f"adapter B {tuple(b.shape)} (unit column stride) does not match {r} rank values")
    return b, t, b.stride(0), r, triton.next_power_of_2(r)


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
    product is scaled by rsqrt(ss / K + eps) before the bias. `lora` = (B, t): an unmerged
    adapter, B (rows, r) pre-scaled and t = A h (r,) its shrink; row n gains sum_r B[n, r] t[r]
    before RoPE."""
    n_kv, d = k_cache.shape[1], k_cache.shape[3]
    k = weight.shape[1]
    if weight.shape[0] != (n_heads + 2 * n_kv) * d or d % 2 or u.numel() != k:
        raise ValueError(f"q/k/v weight {tuple(weight.shape)} does not match {n_heads}+2x{n_kv} heads of {d}")
    q = torch.empty((n_heads, d), dtype=u.dtype, device=u.device)
    half = d // 2
    block_p = _pair_rows(half)
    ss, eps = _norm_args(norm, u)
    lb, lt, stride_b, r, block_r = _lora_args(lora, u)
    _qkv_rope_cache_kernel[((n_heads + 2 * n_kv) * (half // block_p),)](
        u, weight, weight if bias is None else bias, q, k_cache, v_cache, cos, sin, col, pad, ss, lb, lt,
        weight.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), cos.stride(0),
        float(eps), stride_b, N_HEADS=n_heads, N_KV=n_kv, D=d, K=k, HAS_BIAS=bias is not None,
        HAS_NORM=norm is not None, R=r, BLOCK_R=block_r,
        BLOCK_P=block_p, num_warps=_WARPS, **k_launch(k, _BLOCK_K),
    )
    return q


def glu(
    u: torch.Tensor,
    weight: torch.Tensor,
    inter: int,
    gelu: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """u (K,) one row; weight (>= 2 inter, K) rows gate | up -> act(gate) * up, (inter,).
    act: SiLU, or tanh-approximate GELU with `gelu`; `norm`, `lora` (B with 2 inter rows) as in
    `qkv_rope_cache`."""
    k = weight.shape[1]
    out = torch.empty(inter, dtype=u.dtype, device=u.device)
    block_p = _pair_rows(inter)
    ss, eps = _norm_args(norm, u)
    lb, lt, stride_b, r, block_r = _lora_args(lora, u)
    _glu_kernel[(triton.cdiv(inter, block_p),)](
        u, weight, out, ss, lb, lt, weight.stride(0), float(eps), stride_b, INTER=inter, K=k, GELU=gelu,
        HAS_NORM=norm is not None, R=r, BLOCK_R=block_r,
        BLOCK_P=block_p, num_warps=_WARPS, **k_launch(k, _BLOCK_K),
    )
    return out


def residual(
    a: torch.Tensor,
    weight: torch.Tensor,
    res: torch.Tensor,
    norm_weight: torch.Tensor,
    ss: torch.Tensor,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a (K,) one row; weight (N, K); res, norm_weight (N,); ss (1,) float32, zero before the
    launch -> x' = res + W a and u = norm_weight * x', each (N,); ss += sum(x'^2).
    The next product finishes the RMSNorm: rsqrt(ss / N + eps) W' u = W' RMSNorm(x').
    `lora` as in `qkv_rope_cache` (added to W a before the residual)."""
    n, k = weight.shape
    x = torch.empty(n, dtype=res.dtype, device=res.device)
    u = torch.empty_like(x)
    block_n = 32 if interpreted() else _RESIDUAL_ROWS
    lb, lt, stride_b, r, block_r = _lora_args(lora, a)
    _residual_kernel[(triton.cdiv(n, block_n),)](
        a, weight, res, x, norm_weight, u, ss, lb, lt, weight.stride(0), stride_b,
        N=n, K=k, R=r, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=_WARPS, **k_launch(k, _BLOCK_K),
    )
    return x, u
