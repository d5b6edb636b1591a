"""RMSNorm with the exact casting of Hugging Face's Llama and Gemma3 norms.

    rstd   = 1 / sqrt(mean(x^2) + eps)                      (fp32, one value per row)
    n      = x * rstd                                       (fp32)
    llama:  y = (offset + w) * n.to(x.dtype)                (LlamaRMSNorm, Mistral, Qwen2/3)
    gemma:  y = (n * (offset + w.float())).to(x.dtype)      (Gemma3RMSNorm, offset = 1)

Layout: x (..., hidden) is viewed as rows (n_rows, hidden) with any row stride and unit column
stride; the forward grid is one program per row. Only x and the fp32 rstd (4 bytes a row) are
kept for the backward pass; n is recomputed there.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from kernels._utils import as_rows, block_and_warps, sm_count
from kernels.dispatch import use_triton

Casting = Literal["llama", "gemma"]

# Backward programs per SM: several resident programs hide the load latency of the row loop.
_BWD_PROGRAMS_PER_SM = 4


@triton.jit
def _rms_norm_fwd_kernel(
    Y, y_row_stride, X, x_row_stride, W, RSTD,
    n_cols, eps, offset,
    GEMMA: tl.constexpr, BLOCK: tl.constexpr,
):
    # grid: (n_rows,); one row of `n_cols` per program, int64 row offsets.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = x * rstd
    if not GEMMA:
        # Llama rounds the normalised value to the input dtype before the weight multiply.
        normed = normed.to(X.dtype.element_ty).to(tl.float32)
    y = normed * (offset + w)
    tl.store(Y + row * y_row_stride + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    DX, dx_row_stride, DY, dy_row_stride, X, x_row_stride, W, RSTD, DW_PARTIAL,
    n_rows, n_cols, offset,
    ROWS_PER_PROGRAM: tl.constexpr, GEMMA: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grid: (programs,); each program walks ROWS_PER_PROGRAM consecutive rows (masked past
    # n_rows) and keeps its share of dw in registers, written once to DW_PARTIAL[program, :]
    # and summed on the host side.
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * ROWS_PER_PROGRAM
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    scale = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, ROWS_PER_PROGRAM):
        row = row_start + i
        mask = col_mask & (row < n_rows)
        x = tl.load(X + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row < n_rows, other=0.0)
        normed = x * rstd
        dn = dy * scale
        # dx = rstd * (dn - n * mean(dn * n))
        dx = rstd * (dn - normed * (tl.sum(dn * normed, axis=0) / n_cols))
        tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if GEMMA:
                dw_acc += dy * normed
            else:
                dw_acc += dy * normed.to(X.dtype.element_ty).to(tl.float32)
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. x (..., hidden), weight (hidden,).

    Returns y (x.shape; dtype x.dtype for gemma, promote(x, w) for llama as in HF), the 2-D view
    x_rows (n_rows, hidden) and rstd (n_rows,) fp32.
    """
    x_rows = as_rows(x)
    n_rows, n_cols = x_rows.shape
    out_dtype = x.dtype if gemma else torch.promote_types(x.dtype, weight.dtype)
    # Allocated in x's shape and launched on its row view, so y is not itself a view: a view
    # returned from an autograd Function has an internal, grad-less `_base`, which code that
    # follows `_base` to the storage root (rope_) would take for the real tensor.
    y_full = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    y = y_full.view(n_rows, n_cols)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows > 0:
        block, warps = block_and_warps(n_cols)
        _rms_norm_fwd_kernel[(n_rows,)](
            y, y.stride(0), x_rows, x_rows.stride(0), weight.contiguous(), rstd,
            n_cols, eps, offset,
            GEMMA=gemma, BLOCK=block, num_warps=warps,
        )
    return y_full, x_rows, rstd


def rms_norm_backward(
    dy: torch.Tensor, x_rows: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    offset: float, gemma: bool, compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernel. dy (..., hidden) -> dx (n_rows, hidden), dw (hidden,) or None.

    With s = offset + w and n = x * rstd (fp32):
        dn = dy * s
        dx = rstd * (dn - n * sum(dn * n) / hidden)       (derivative through rstd included)
        dw = sum over rows of dy * n  (llama: n rounded to x.dtype first, as HF's graph sees it)
    """
    dy_rows = as_rows(dy)
    n_rows, n_cols = x_rows.shape
    dx = torch.empty((n_rows, n_cols), dtype=x_rows.dtype, device=x_rows.device)
    # The trip count is a power of two and a compile-time constant: at most ~17 compiled
    # variants whatever the sequence lengths (and Triton's CPU interpreter, under NumPy 2,
    # cannot loop to a runtime bound).
    target = _BWD_PROGRAMS_PER_SM * sm_count(x_rows.device)
    rows_per_program = triton.next_power_of_2(triton.cdiv(max(n_rows, 1), target))
    programs = triton.cdiv(max(n_rows, 1), rows_per_program)
    dw_partial = (
        torch.empty((programs, n_cols), dtype=torch.float32, device=x_rows.device)
        if compute_dw else rstd  # placeholder pointer, never touched when COMPUTE_DW is False
    )
    if n_rows > 0:
        block, warps = block_and_warps(n_cols)
        _rms_norm_bwd_kernel[(programs,)](
            dx, dx.stride(0), dy_rows, dy_rows.stride(0), x_rows, x_rows.stride(0),
            weight.contiguous(), rstd, dw_partial,
            n_rows, n_cols, offset,
            ROWS_PER_PROGRAM=rows_per_program, GEMMA=gemma, COMPUTE_DW=compute_dw, BLOCK=block, num_warps=warps,
        )
    if not compute_dw:
        return dx, None
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    return dx, dw_partial.sum(0).to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: saves x (as its 2-D row view), weight and rstd; nothing else."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, gemma):  # type: ignore[override]
        y, x_rows, rstd = rms_norm_forward(x, weight, eps, offset, gemma)
        ctx.save_for_backward(x_rows, weight, rstd)
        ctx.offset, ctx.gemma, ctx.x_shape = offset, gemma, x.shape
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x_rows, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(
            dy, x_rows, weight, rstd, ctx.offset, ctx.gemma, ctx.needs_input_grad[1]
        )
        return dx.view(ctx.x_shape), dw, None, None, None


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
