"""The short causal depthwise convolution of a linear-attention layer (Qwen3.5's gated delta
rule: width w = 4 over the q/k/v channels), with each packed sample on its own.

    pre_t = b + sum_{j < w, j <= o_t} W[:, w-1-j] * x_{t-j}          (per channel)
    y_t   = silu(pre_t)  (or pre_t without an activation)

x (B, T, C), W (C, w), b (C,), o (B, T): each token's offset from its sample's first token
(`kestrel.model.linear_attention.segment_offsets`; o_t = t for one sample a row), so a sample
sees zeros before its first token, as when it is alone.

Backward, with d_t = dy_t * silu'(pre_t) (silu'(p) = s + p s (1 - s), s = sigmoid(p)):

    dx_t         = sum_{j < w} W[:, w-1-j] * d_{t+j} * [o_{t+j} >= j]
    dW[:, w-1-j] = sum_t d_t * x_{t-j} * [o_t >= j]
    db           = sum_t d_t

Triton layout: rows are the B*T tokens, so a (BLOCK_T, BLOCK_C) tile reads rows t-j of the same
channels (neighbouring tiles share them through the cache; o keeps a tile from reaching into
another sample or row). The forward, one tile a program, writes only y. The backward, with SiLU,
is two passes over the tokens:

1. `_bwd_kernel`, grid (programs, C / BLOCK_C): each program walks its run of rows BWD_T at a
   time, loads dy and the w shifted x tiles once, computes pre once (the forward's helpers) and
   d in fp32, and stores d, a (B, T, C) buffer in x's dtype. The same tiles give its dW and db
   shares: d_t * x_{t-j} and d_t add elementwise into w + 1 fp32 (BWD_T, BLOCK_C) tiles held in
   registers, whose rows are summed once, after the walk, into dw_part (programs, w, C) and
   db_part (programs, C), fp32; the host sums those over programs.
2. `_dx_kernel`, one tile a program as the forward: dx from the w shifted tiles of d.

d is stored because dx_t needs d at t .. t+w-1, across tile and program boundaries: getting it
without a buffer means recomputing pre at each of those rows (w^2 x loads and w sigmoids a
token, what an earlier single kernel did at ~10x the memory bound). It is kept in x's dtype: bf16
halves its bytes against fp32, and HF's autograd rounds the gradient to bf16 at the same place
(silu's backward); dW and db take d before that rounding. Bytes a bf16 element: x, dy read and d
written (6), then d read and dx written (4), against 6 for x, dy and dx alone; the shifted loads
(w of x, w of d) hit the cache. Without an activation d = dy: `_bwd_kernel` writes dx from the
shifted dy tiles itself, one pass of 6 bytes, and no d buffer exists.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kestrel.kernels._launch import launch
from kestrel.kernels._utils import cdiv, round_up_coarse, sm_count
from kestrel.kernels.dispatch import use_triton

ACTIVATIONS = (None, "silu", "swish")  # swish is silu's other name in HF configs
# A tile of BLOCK_T tokens by BLOCK_C channels: 4,096 elements, 32 a thread at 4 warps, the size
# at which memory-bound row kernels reach copy bandwidth (as `kestrel.kernels.rms_norm`): the
# forward and `_dx_kernel`, one tile a program.
BLOCK_T, BLOCK_C, WARPS = 16, 256, 4
# `_bwd_kernel` walks rows BWD_T at a time and keeps w + 1 fp32 tiles of its dW and db shares in
# registers (16 a thread each): ~240 registers a thread at w = 4, so two programs fit an SM. One
# resident wave of programs then covers the rows (more waves measured slower: a tail, and no more
# of them in flight), and summing the tiles' rows happens once, after the walk.
BWD_T = 8
_WAVES = 2  # backward programs per SM


@triton.jit
def _taps(Wt, B, cols, col_ok, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr):
    # W[:, w-1-j] for j < w, then b (zeros without a bias): w + 1 fp32 (BC,) rows, loaded once a
    # program (inside a loop that stores, the compiler would reload them every tile).
    taps = ()
    for j in tl.static_range(WIDTH):
        taps = taps + (tl.load(Wt + cols * WIDTH + (WIDTH - 1 - j), mask=col_ok, other=0.0).to(tl.float32),)
    if HAS_BIAS:
        return taps + (tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32),)
    return taps + (tl.zeros_like(taps[0]),)


@triton.jit
def _shifted(X, rows, cols, off, row_ok, col_ok, n_cols, WIDTH: tl.constexpr):
    # x_{t-j} [o_t >= j] for j < w, tokens `rows` (BT,), channels `cols` (BC,): w fp32 (BT, BC) tiles.
    xs = ()
    for j in tl.static_range(WIDTH):
        ok = (row_ok & (off >= j))[:, None] & col_ok[None, :]
        xs = xs + (tl.load(X + (rows - j)[:, None] * n_cols + cols[None, :], mask=ok, other=0.0).to(tl.float32),)
    return xs


@triton.jit
def _pre(xs, taps, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr):
    # pre from the shifted tiles: fp32 (BT, BC).
    acc = xs[0] * taps[0][None, :]
    for j in tl.static_range(1, WIDTH):
        acc += xs[j] * taps[j][None, :]
    if HAS_BIAS:
        acc += taps[WIDTH][None, :]
    return acc


@triton.jit
def _dx(D, taps, OFF, rows, cols, row_ok, col_ok, n_rows, n_cols,
        WIDTH: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    # dx for tokens `rows` (BT,) and channels `cols` (BC,): fp32 (BT, BC), from d at rows t .. t+w-1.
    dx = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(WIDTH):  # token t+j, where it is in t's sample, reads x_t through tap w-1-j
        later = rows + j
        inside = row_ok & (later < n_rows)
        same = inside & (tl.load(OFF + later, mask=inside, other=-1) >= j)
        d = tl.load(D + later[:, None] * n_cols + cols[None, :], mask=same[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        dx += d * taps[j][None, :]
    return dx


@triton.jit
def _fwd_kernel(Y, X, Wt, B, OFF, n_rows, n_cols,
                WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                BT: tl.constexpr, BC: tl.constexpr):
    # grid (cdiv(n_rows, BT), cdiv(n_cols, BC)): one tile per program.
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    off = tl.load(OFF + rows, mask=row_ok, other=0)
    taps = _taps(Wt, B, cols, col_ok, WIDTH, HAS_BIAS)
    pre = _pre(_shifted(X, rows, cols, off, row_ok, col_ok, n_cols, WIDTH), taps, WIDTH, HAS_BIAS)
    if SILU:
        pre = pre * tl.sigmoid(pre)
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], pre.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _bwd_kernel(D, DX, DW_PART, DB_PART, DY, X, Wt, B, OFF, n_rows, n_cols,
                ROWS_PER_PROGRAM: tl.constexpr, WIDTH: tl.constexpr,
                HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                BT: tl.constexpr, BC: tl.constexpr):
    # grid (programs, cdiv(n_cols, BC)): program p walks rows [p * ROWS_PER_PROGRAM, ...) BT at a
    # time. Each tile: d (fp32) from dy and pre, stored to D with SILU (for `_dx_kernel`), else
    # d = dy and dx is stored here; d * x_{t-j} and d add into fp32 (BT, BC) register tiles (dw[j]
    # is tap w-1-j), whose rows are summed and stored once, after the walk.
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    col_ok = cols < n_cols
    taps = _taps(Wt, B, cols, col_ok, WIDTH, HAS_BIAS)
    dw = (tl.zeros((BT, BC), dtype=tl.float32),) * WIDTH
    db = tl.zeros((BT, BC), dtype=tl.float32)
    first = pid.to(tl.int64) * ROWS_PER_PROGRAM
    for start in tl.range(0, ROWS_PER_PROGRAM, BT):  # whole tiles: no row past the program's
        rows = first + start + tl.arange(0, BT)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        off = tl.load(OFF + rows, mask=row_ok, other=0)
        d = tl.load(DY + rows[:, None] * n_cols + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        xs = _shifted(X, rows, cols, off, row_ok, col_ok, n_cols, WIDTH)
        if SILU:
            pre = _pre(xs, taps, WIDTH, HAS_BIAS)
            s = tl.sigmoid(pre)
            d = d * (s + pre * s * (1.0 - s))
            tl.store(D + rows[:, None] * n_cols + cols[None, :], d.to(D.dtype.element_ty), mask=ok)
        else:
            dx = _dx(DY, taps, OFF, rows, cols, row_ok, col_ok, n_rows, n_cols, WIDTH, BT, BC)
            tl.store(DX + rows[:, None] * n_cols + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
        shares = ()
        for j in tl.static_range(WIDTH):
            shares = shares + (dw[j] + d * xs[j],)
        dw = shares
        db += d
    for j in tl.static_range(WIDTH):
        tl.store(DW_PART + (pid.to(tl.int64) * WIDTH + (WIDTH - 1 - j)) * n_cols + cols, tl.sum(dw[j], axis=0),
                 mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PART + pid.to(tl.int64) * n_cols + cols, tl.sum(db, axis=0), mask=col_ok)


@triton.jit
def _dx_kernel(DX, D, Wt, OFF, n_rows, n_cols, WIDTH: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    # grid (cdiv(n_rows, BT), cdiv(n_cols, BC)), as the forward: dx of one tile from d.
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    taps = _taps(Wt, Wt, cols, col_ok, WIDTH, False)
    dx = _dx(D, taps, OFF, rows, cols, row_ok, col_ok, n_rows, n_cols, WIDTH, BT, BC)
    tl.store(DX + rows[:, None] * n_cols + cols[None, :], dx.to(DX.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _offsets_or_positions(x: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """(B*T,) int64 offsets: those given (one row of them stands for every row), or t itself
    (one sample a row)."""
    if offsets is None:
        offsets = torch.arange(x.shape[1], device=x.device)
    return offsets.expand(x.shape[:2]).reshape(-1).to(torch.int64).contiguous()


@functools.lru_cache(maxsize=None)
def _rows_per_program(n_rows: int, n_cols: int, sms: int) -> int:
    """Rows each backward program walks: about _WAVES programs per SM over all channel blocks,
    in whole tiles, their count rounded coarsely (a compile-time constant: packed rows' widths
    vary from batch to batch, and each distinct value compiles once)."""
    programs = max(1, min(cdiv(n_rows, BLOCK_T), cdiv(_WAVES * sms, cdiv(n_cols, BLOCK_C))))
    return round_up_coarse(cdiv(n_rows, programs * BLOCK_T)) * BLOCK_T


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                offsets: torch.Tensor | None, silu: bool) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        off = _offsets_or_positions(x, offsets)
        n_cols, width = x.shape[-1], weight.shape[-1]
        n_rows = x.numel() // n_cols
        y = torch.empty_like(x)
        grid = (cdiv(n_rows, BLOCK_T), cdiv(n_cols, BLOCK_C))
        launch(_fwd_kernel, grid, y, x, weight, bias if bias is not None else weight, off, n_rows, n_cols,
               width, bias is not None, silu, BLOCK_T, BLOCK_C, num_warps=WARPS)
        ctx.save_for_backward(x, weight, bias, off)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, weight, bias, off = ctx.saved_tensors
        dy = dy.contiguous()
        n_cols, width = x.shape[-1], weight.shape[-1]
        n_rows = x.numel() // n_cols
        per = _rows_per_program(n_rows, n_cols, sm_count(x.device))
        assert per % BWD_T == 0, "the backward walks whole BWD_T tiles: no row past a program's run"
        programs, col_blocks = cdiv(n_rows, per), cdiv(n_cols, BLOCK_C)
        dx = torch.empty_like(x)
        d = torch.empty_like(x) if ctx.silu else dx  # d in x's dtype: see the module docstring
        dw_part = torch.empty(programs, width, n_cols, device=x.device, dtype=torch.float32)
        db_part = torch.empty(programs, n_cols, device=x.device, dtype=torch.float32) if bias is not None else dw_part
        launch(_bwd_kernel, (programs, col_blocks),
               d, dx, dw_part, db_part, dy, x, weight, bias if bias is not None else weight, off, n_rows, n_cols,
               per, width, bias is not None, ctx.silu, BWD_T, BLOCK_C, num_warps=WARPS)
        if ctx.silu:
            launch(_dx_kernel, (cdiv(n_rows, BLOCK_T), col_blocks), dx, d, weight, off, n_rows, n_cols,
                   width, BLOCK_T, BLOCK_C, num_warps=WARPS)
        dweight = dw_part.sum(0).t().to(weight.dtype)
        dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dweight, dbias, None, None


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """`short_conv` in PyTorch: w shifted products, summed in fp32 (or wider), masked at each
    sample's start; autograd gives the backward."""
    width, wide = weight.shape[-1], torch.promote_types(x.dtype, torch.float32)
    w = weight.to(wide)
    acc = x.to(wide) * w[:, -1]
    for j in range(1, min(width, x.shape[1])):
        shifted = torch.nn.functional.pad(x[:, :-j], (0, 0, j, 0)).to(wide) * w[:, width - 1 - j]
        acc = acc + (shifted if offsets is None else shifted.masked_fill((offsets < j).unsqueeze(-1), 0.0))
    if bias is not None:
        acc = acc + bias.to(wide)
    if activation is not None:
        acc = torch.nn.functional.silu(acc)
    return acc.to(x.dtype)


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
               offsets: torch.Tensor | None = None) -> torch.Tensor:
    """The short causal depthwise convolution (see the module docstring): x (B, T, C), weight
    (C, w), bias (C,) or None, activation None or "silu", offsets (B, T) or None (one sample a
    row) -> (B, T, C) in x's dtype."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear attention's convolution has an activation Kestrel does not know: {activation!r} "
                         f"(it knows {', '.join(str(a) for a in ACTIVATIONS)})")
    if use_triton(x):
        return _ShortConv.apply(x, weight, bias, offsets, activation is not None)
    return short_conv_reference(x, weight, bias, activation, offsets)
