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
another sample or row). The forward writes only y. The backward recomputes pre at the w rows
each dx needs (w^2 products a token: the kernel stays bound by memory) and keeps its programs'
shares of dW and db in fp32 registers, one (w, C) and one (C,) row per program, which the host
sums: nothing of x's size is written besides dx.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kestrel.kernels._launch import launch
from kestrel.kernels._utils import cdiv, next_pow2, round_up_coarse, sm_count
from kestrel.kernels.dispatch import use_triton

ACTIVATIONS = (None, "silu", "swish")  # swish is silu's other name in HF configs
# A tile of BLOCK_T tokens by BLOCK_C channels: 4,096 elements, 16 a thread at 4 warps, the size
# at which memory-bound row kernels reach copy bandwidth (as `kestrel.kernels.rms_norm`).
BLOCK_T, BLOCK_C, WARPS = 16, 256, 4
_WAVES = 4  # backward programs per SM: enough to cover memory latency, few partial rows to sum


@triton.jit
def _pre(X, Wt, B, rows, cols, off, row_ok, col_ok, n_cols,
         WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    # pre for tokens `rows` (BT,) and channels `cols` (BC,): fp32 (BT, BC).
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        ok = (row_ok & (off >= j))[:, None] & col_ok[None, :]
        x = tl.load(X + (rows - j)[:, None] * n_cols + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(Wt + cols * WIDTH + (WIDTH - 1 - j), mask=col_ok, other=0.0).to(tl.float32)
        acc += x * w[None, :]
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _fwd_kernel(Y, X, Wt, B, OFF, n_rows, n_cols,
                WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                BT: tl.constexpr, BC: tl.constexpr):
    # grid (cdiv(n_rows, BT), cdiv(n_cols, BC)): one tile per program.
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    off = tl.load(OFF + rows, mask=row_ok, other=0)
    pre = _pre(X, Wt, B, rows, cols, off, row_ok, col_ok, n_cols, WIDTH, HAS_BIAS, BT, BC)
    if SILU:
        pre = pre * tl.sigmoid(pre)
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], pre.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _bwd_kernel(DX, DW_PART, DB_PART, DY, X, Wt, B, OFF, n_rows, n_cols,
                ROWS_PER_PROGRAM: tl.constexpr, WIDTH: tl.constexpr, WPAD: tl.constexpr,
                HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                BT: tl.constexpr, BC: tl.constexpr):
    # grid (programs, cdiv(n_cols, BC)): program p walks rows [p * ROWS_PER_PROGRAM, ...) BT at a
    # time; its dW share (WPAD, BC) and db share (BC,) stay in registers, written once.
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    col_ok = cols < n_cols
    taps = tl.arange(0, WPAD)
    dw = tl.zeros((WPAD, BC), dtype=tl.float32)
    db = tl.zeros((BC,), dtype=tl.float32)
    first = pid.to(tl.int64) * ROWS_PER_PROGRAM
    for start in tl.range(0, ROWS_PER_PROGRAM, BT):
        rows = first + start + tl.arange(0, BT)
        row_ok = (rows < n_rows) & (start + tl.arange(0, BT) < ROWS_PER_PROGRAM)
        off = tl.load(OFF + rows, mask=row_ok, other=0)
        dx = tl.zeros((BT, BC), dtype=tl.float32)
        d0 = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(WIDTH):  # token t+j, where it is in t's sample, reads x_t through tap w-1-j
            later = rows + j
            later_off = tl.load(OFF + later, mask=row_ok & (later < n_rows), other=-1)
            same = row_ok & (later < n_rows) & (later_off >= j)
            d = tl.load(DY + later[:, None] * n_cols + cols[None, :], mask=same[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            if SILU:
                pre = _pre(X, Wt, B, later, cols, later_off, same, col_ok, n_cols, WIDTH, HAS_BIAS, BT, BC)
                s = tl.sigmoid(pre)
                d = d * (s + pre * s * (1.0 - s))
            w = tl.load(Wt + cols * WIDTH + (WIDTH - 1 - j), mask=col_ok, other=0.0).to(tl.float32)
            dx += d * w[None, :]
            if j == 0:
                d0 = d
        tl.store(DX + rows[:, None] * n_cols + cols[None, :], dx.to(DX.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
        for j in tl.static_range(WIDTH):
            ok = (row_ok & (off >= j))[:, None] & col_ok[None, :]
            x = tl.load(X + (rows - j)[:, None] * n_cols + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            dw += tl.where(taps[:, None] == WIDTH - 1 - j, tl.sum(d0 * x, axis=0)[None, :], 0.0)
        db += tl.sum(d0, axis=0)
    tl.store(DW_PART + (pid.to(tl.int64) * WPAD + taps[:, None]) * n_cols + cols[None, :], dw,
             mask=(taps < WIDTH)[:, None] & col_ok[None, :])
    if HAS_BIAS:
        tl.store(DB_PART + pid.to(tl.int64) * n_cols + cols, db, mask=col_ok)


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
        programs, wpad = cdiv(n_rows, per), next_pow2(width)
        dx = torch.empty_like(x)
        dw_part = torch.empty(programs, wpad, n_cols, device=x.device, dtype=torch.float32)
        db_part = torch.empty(programs, n_cols, device=x.device, dtype=torch.float32) if bias is not None else dw_part
        launch(_bwd_kernel, (programs, cdiv(n_cols, BLOCK_C)),
               dx, dw_part, db_part, dy, x, weight, bias if bias is not None else weight, off, n_rows, n_cols, per,
               width, wpad, bias is not None, ctx.silu, BLOCK_T, BLOCK_C, num_warps=WARPS)
        dweight = dw_part[:, :width].sum(0).t().to(weight.dtype)
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
