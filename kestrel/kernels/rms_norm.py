"""RMSNorm with the exact casting of Hugging Face's Llama and Gemma3 norms.

    rstd   = 1 / sqrt(mean(x^2) + eps)                      (fp32, one value per row)
    n      = x * rstd                                       (fp32)
    llama:  y = (offset + w) * n.to(x.dtype)                (LlamaRMSNorm, Mistral, Qwen2/3)
    gemma:  y = (n * (offset + w.float())).to(x.dtype)      (Gemma3RMSNorm, offset = 1)

Layout: x (..., hidden) is viewed as rows (n_rows, hidden) with any row stride and unit column
stride. Both kernels work on (ROWS, BLOCK) tiles: BLOCK = next_pow2(hidden) columns and
ROWS = max(1, _TILE // BLOCK) rows, so a tile holds at least _TILE elements whatever the width
(hidden 4096: one row; QK-norm rows of head_dim 128: 32 rows).

- forward, grid (cdiv(n_rows, ROWS),): one tile per program. Only x and the fp32 rstd (4 bytes
  a row) are kept for the backward; n is recomputed there.
- backward, persistent grid of _BWD_WARPS_PER_SM warps' worth of programs per SM: each walks
  ROWS_PER_PROGRAM consecutive rows tile by tile, with the loads of the next _BWD_STAGES - 1
  tiles in flight (Triton's loop pipeliner copies them to shared memory with cp.async), and
  keeps its share of dw in fp32 registers; one (hidden,) fp32 row per program is written and
  the host sums those few rows. Nothing of x's size is written besides dx.

Small shapes are bound by the host: launch plans are lru-cached per shape, strides and dtypes,
and x and dy are read in place as rows whenever their strides allow.
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple

import torch
import triton
import triton.language as tl

from kestrel.kernels._launch import launch
from kestrel.kernels._utils import as_rows, block_and_warps, cdiv, round_up_coarse, row_stride, sm_count
from kestrel.kernels.dispatch import use_triton

Casting = Literal["llama", "gemma"]

# Elements per (ROWS, BLOCK) tile: 8 KB of bf16 per load, 16 elements per thread at 8 warps,
# the per-program size at which Triton's row kernels (and Liger's) reach copy bandwidth.
_TILE = 4096
# Backward occupancy, in warps per SM. The kernel needs 100-125 registers a thread (ptxas,
# sm_90, bf16 or fp32, either casting) whatever the width, since a tile is ~16 elements a
# thread; 16 warps of that fill the 64K-register file. Hidden 4096 (8 warps): two programs
# per SM, all resident at once (one wave), each with two tiles' loads in flight: 64 KB of x
# and dy per SM, over twice what current GPUs need to cover DRAM latency. Shared memory for
# the pipeline, 32 KB per program at 4096, is not the limit.
_BWD_WARPS_PER_SM = 16
# Tiles in the loop pipeline: the current one plus two whose loads are in flight, fewer when
# the in-flight tiles of x and dy would pass _BWD_SMEM_BYTES of shared memory (hidden 16384 in
# fp32, 32768 in bf16): 128 KB leaves room for the reduction scratch on an A100 (164 KB) too.
_BWD_STAGES = 3
_BWD_SMEM_BYTES = 128 * 1024


@triton.jit
def _rms_norm_fwd_kernel(
    Y, X, W, RSTD, eps, offset, y_row_stride, x_row_stride, n_rows, n_cols,
    GEMMA: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    # grid: (cdiv(n_rows, ROWS),); one (ROWS, BLOCK) tile per program, int64 row offsets.
    # Arguments: pointers, per-call floats, then what `_fwd_plan` fixes for a shape.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # (ROWS,)
    normed = x * rstd[:, None]
    if not GEMMA:
        # Llama rounds the normalised value to the input dtype before the weight multiply.
        normed = normed.to(X.dtype.element_ty).to(tl.float32)
    y = normed * (offset + w)[None, :]
    tl.store(Y + rows[:, None] * y_row_stride + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DX, DY, X, W, RSTD, DW_PARTIAL, offset, dx_row_stride, dy_row_stride, x_row_stride,
    n_rows, n_cols,
    ROWS_PER_PROGRAM: tl.constexpr, GEMMA: tl.constexpr, COMPUTE_DW: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # grid: (programs,); program p owns rows [p * ROWS_PER_PROGRAM, (p + 1) * ROWS_PER_PROGRAM)
    # (masked past n_rows), walked ROWS at a time. Its dw share stays in registers and is
    # written once, to DW_PARTIAL[p, :].
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * ROWS_PER_PROGRAM
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    scale = (tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset)[None, :]
    dw_acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for start in tl.range(0, ROWS_PER_PROGRAM, ROWS, num_stages=NUM_STAGES):
        rows = first + start + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]
        normed = x * rstd
        dn = dy * scale
        # dx = rstd * (dn - n * mean(dn * n)); masked rows and columns give 0 and are not stored.
        dx = rstd * (dn - normed * (tl.sum(dn * normed, axis=1) / n_cols)[:, None])
        tl.store(DX + rows[:, None] * dx_row_stride + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if not GEMMA:
                normed = normed.to(X.dtype.element_ty).to(tl.float32)
            dw_acc += dy * normed
    if COMPUTE_DW:
        dw = tl.sum(dw_acc, axis=0)
        tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw, mask=col_mask)


@functools.lru_cache(maxsize=None)
def _tile(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps) of the (ROWS, BLOCK) tile for rows of `n_cols`."""
    block, _ = block_and_warps(n_cols)
    rows = max(1, _TILE // block)
    return block, rows, block_and_warps(rows * block)[1]


def _bwd_stages(tile_bytes: int) -> int:
    """Pipeline depth for a (ROWS, BLOCK) tile of x plus dy of `tile_bytes` (see _BWD_STAGES)."""
    stages = _BWD_STAGES
    while stages > 1 and (stages - 1) * tile_bytes > _BWD_SMEM_BYTES:
        stages -= 1
    return stages


class _FwdPlan(NamedTuple):
    """The forward launch for one shape, stride set and dtype pair (see `_fwd_plan`)."""

    n_rows: int
    out_dtype: torch.dtype
    row_stride: int | None  # x read in place as rows at this stride; None: `as_rows` copies
    grid: tuple[int] | None  # None: no rows, no launch
    tail: tuple  # n_rows, n_cols, GEMMA, ROWS, BLOCK: the kernel's last arguments
    num_warps: int


@functools.lru_cache(maxsize=512)
def _fwd_plan(
    shape: torch.Size, stride: tuple[int, ...], x_dtype: torch.dtype, w_dtype: torch.dtype, gemma: bool
) -> _FwdPlan:
    """Everything the forward derives from x's shape, strides and the dtypes; cached, so a
    repeated shape costs one lookup and a new shape or stride gets its own plan."""
    n_cols = shape[-1]
    n_rows = math.prod(shape[:-1])
    out_dtype = x_dtype if gemma else torch.promote_types(x_dtype, w_dtype)
    if n_rows == 0:
        return _FwdPlan(n_rows, out_dtype, row_stride(shape, stride), None, (), 0)
    block, rows, warps = _tile(n_cols)
    return _FwdPlan(n_rows, out_dtype, row_stride(shape, stride), (cdiv(n_rows, rows),),
                    (n_rows, n_cols, gemma, rows, block), warps)


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. x (..., hidden), weight (hidden,).

    Returns y (x.shape; dtype x.dtype for gemma, promote(x, w) for llama as in HF), x_rows and
    rstd (n_rows,) fp32. x_rows is what the backward reads: x itself when its rows can be read
    in place (any row stride, see `row_stride`), else `as_rows(x)`, a (n_rows, hidden) copy.
    """
    plan = _fwd_plan(x.shape, x.stride(), x.dtype, weight.dtype, gemma)
    x_rows, x_row_stride = x, plan.row_stride
    if x_row_stride is None:
        x_rows = as_rows(x)
        x_row_stride = x_rows.stride(0)
    # Allocated in x's shape (rows of stride hidden), not as a view: a view returned from an
    # autograd Function has an internal, grad-less `_base`, which code that follows `_base` to
    # the storage root (rope_) would take for the real tensor.
    y = torch.empty(x.shape, dtype=plan.out_dtype, device=x.device)
    rstd = torch.empty(plan.n_rows, dtype=torch.float32, device=x.device)
    if plan.grid is not None:
        launch(
            _rms_norm_fwd_kernel, plan.grid, y, x_rows,
            weight if weight.is_contiguous() else weight.contiguous(), rstd, eps, offset,
            x.shape[-1], x_row_stride, *plan.tail, num_warps=plan.num_warps,
        )
    return y, x_rows, rstd


@functools.lru_cache(maxsize=512)
def _bwd_plan(
    n_rows: int, n_cols: int, x_dtype: torch.dtype, dy_dtype: torch.dtype, device: torch.device,
    gemma: bool, compute_dw: bool,
) -> tuple[int, tuple, int]:
    """(programs, the kernel's last arguments from n_rows on, num_warps) of the backward: a
    persistent grid of _BWD_WARPS_PER_SM warps' worth of programs per SM (see module docstring).
    The trip count is a compile-time constant (Triton's CPU interpreter, under NumPy 2, cannot
    loop to a runtime bound), coarsely rounded so it takes few values."""
    block, rows, warps = _tile(n_cols)
    tiles = max(cdiv(n_rows, rows), 1)
    target = max(1, _BWD_WARPS_PER_SM // warps) * sm_count(device)
    tiles_per_program = round_up_coarse(cdiv(tiles, target))
    stages = _bwd_stages(rows * block * (x_dtype.itemsize + dy_dtype.itemsize))
    tail = (n_rows, n_cols, tiles_per_program * rows, gemma, compute_dw, rows, block, stages)
    return cdiv(tiles, tiles_per_program), tail, warps


def rms_norm_backward(
    dy: torch.Tensor, x_rows: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    offset: float, gemma: bool, compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernel. dy (..., hidden), x_rows as `rms_norm_forward` returned it
    -> dx (dy's shape, x's dtype), dw (hidden,) or None.

    With s = offset + w and n = x * rstd (fp32):
        dn = dy * s
        dx = rstd * (dn - n * sum(dn * n) / hidden)       (derivative through rstd included)
        dw = sum over rows of dy * n  (llama: n rounded to x.dtype first, as HF's graph sees it)
    dw is summed per program in fp32 registers, then over the programs' (programs, hidden) fp32
    partials here.
    """
    n_rows, n_cols = rstd.shape[0], x_rows.shape[-1]
    x_row_stride = row_stride(x_rows.shape, x_rows.stride())
    if x_row_stride is None:  # no rows (x_rows is row-readable by construction otherwise)
        x_rows = as_rows(x_rows)
        x_row_stride = x_rows.stride(0)
    dy_rows, dy_row_stride = dy, row_stride(dy.shape, dy.stride())
    if dy_row_stride is None:  # e.g. the stride-0 gradient of `.sum()`: copied
        dy_rows = as_rows(dy)
        dy_row_stride = dy_rows.stride(0)
    programs, tail, warps = _bwd_plan(n_rows, n_cols, x_rows.dtype, dy.dtype, x_rows.device, gemma, compute_dw)
    dx = torch.empty(dy.shape, dtype=x_rows.dtype, device=x_rows.device)  # rows of stride n_cols
    dw_partial = (
        torch.empty((programs, n_cols), dtype=torch.float32, device=x_rows.device)
        if compute_dw else rstd  # placeholder pointer, never touched when COMPUTE_DW is False
    )
    if n_rows > 0:
        launch(
            _rms_norm_bwd_kernel, (programs,), dx, dy_rows, x_rows,
            weight if weight.is_contiguous() else weight.contiguous(), rstd,
            dw_partial, offset, n_cols, dy_row_stride, x_row_stride, *tail, num_warps=warps,
        )
    if not compute_dw:
        return dx, None
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    return dx, dw_partial.sum(0).to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: saves x (or its row copy, see `rms_norm_forward`), weight and rstd."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, gemma):  # type: ignore[override]
        y, x_rows, rstd = rms_norm_forward(x, weight, eps, offset, gemma)
        ctx.save_for_backward(x_rows, weight, rstd)
        ctx.offset, ctx.gemma = offset, gemma
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x_rows, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(
            dy, x_rows, weight, rstd, ctx.offset, ctx.gemma, ctx.needs_input_grad[1]
        )
        return dx, dw, None, None, None


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
    casting: Casting = "llama",
) -> torch.Tensor:
    """Plain PyTorch RMSNorm, operation for operation as Hugging Face writes it (autograd-ready)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        scale = weight + offset if offset != 0.0 else weight
        return scale * normed.to(x.dtype)
    return (normed * (offset + weight.float())).type_as(x)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
    casting: Casting = "llama",
) -> torch.Tensor:
    """RMSNorm over the last dimension. x (..., hidden), weight (hidden,) -> y like x.

    casting="llama" matches LlamaRMSNorm (and Mistral, Qwen2, Qwen3): fp32 statistics, the
    normalised value cast to x.dtype, then `weight * normed` (output dtype promote(x, weight)).
    casting="gemma" with offset=1.0 matches Gemma3RMSNorm: everything in fp32,
    `normed * (1 + weight.float())`, cast to x.dtype at the end.
    Gradients flow to x and weight. Triton on CUDA, the reference elsewhere (see dispatch).
    """
    if casting not in ("llama", "gemma"):
        raise ValueError(f"casting must be 'llama' or 'gemma', got {casting!r}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden {x.shape[-1]}")
    if use_triton(x, weight):
        return _RMSNormFunction.apply(x, weight, float(eps), float(offset), casting == "gemma")
    return rms_norm_reference(x, weight, eps, offset, casting)
