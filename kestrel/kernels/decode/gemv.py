"""Matrix-vector product for a one-row decode step: y = W x (+ b), read at copy bandwidth.

At batch 1 every projection of a decode step is a matrix-vector product, and the step's time
is the bytes of W over memory bandwidth. cuBLAS picks tile shapes made for matrices (8-row
output tiles of a 64-128-column MMA) and, for the long or narrow shapes (o, down), split-K with a
second reduction kernel. This kernel is faster than cuBLAS at every Llama-3.1-8B projection shape
(bench/RESULTS.md, Decode "Session 2, later").

Layout: W (N, K) with unit column stride and any row stride (a row slice of a fused q/k/v
buffer is fine); x: one row (..., K), contiguous; y: (..., N) in x's dtype. Grid: cdiv(N,
BLOCK_N) programs. Each owns BLOCK_N = 2 rows and walks K in BLOCK_K = 2048 columns with 2
warps: 64 elements (eight 16-byte loads) of W per thread per step, an fp32 (BLOCK_N, BLOCK_K)
accumulator reduced once at the end, no split-K. In a sweep of block shapes (2-16 rows,
512-2048 columns, 1-8 warps, 1 or 3 stages, early or late reduction) it was the fastest on all
five shapes, with 3 pipeline stages for the long K of `down` and 1 elsewhere (nearly level).
Accumulation is fp32 (fp32 weights too: no TF32).

Rejected: computing the product's input inside it (residual add + RMSNorm, or act(gate) * up),
which would remove the small kernels between products: every program re-reads the input
vectors, and at 2-row tiles those L2 reads cost more than the kernel they save.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels._utils import interpreted, pdl, pdl_launch
from kestrel.kernels.dispatch import use_triton

_BLOCK_N, _BLOCK_K, _WARPS = 2, 2048, 2
_INTERPRETED_BLOCK_N = 32  # the interpreter runs programs one by one: fewer, larger ones


@triton.jit
def dot_rows(X, W, rows, row_ok, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             PDL: tl.constexpr = False):
    """(BLOCK_N,) float32: W[rows] @ x for the vector x at X, K columns in BLOCK_K steps.

    PDL (the launch is a programmatic dependent one): the first W tile is loaded, then the
    program waits for the previous launch (`griddepcontrol.wait`) before it reads x, which that
    launch wrote. W never depends on it, so its first bytes stream while the previous kernel's
    last programs finish. Whatever the caller reads or writes after this returns is ordered
    after the previous launch too."""
    w_rows = W + rows.to(tl.int64)[:, None] * stride_w
    cols = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
    if PDL:
        gdc_wait()
    x = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(X + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First thing a PDL-launched kernel does: let the NEXT launch be scheduled as soon as every
    program of this one has started (it still waits for this one's writes before reading)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def rstd_from(SS, eps, N: tl.constexpr, HAS_NORM: tl.constexpr):
    """1 / sqrt(SS / N + eps) for the sum of squares at SS of an N-vector; 1 without a norm."""
    if HAS_NORM:
        return 1.0 / tl.sqrt(tl.load(SS) / N + eps)
    return 1.0


@triton.jit
def _gemv_kernel(
    X, W, BIAS, Y, SS, N, stride_w, eps,
    K: tl.constexpr,  # constexpr: Triton's interpreter cannot loop to a run-time bound (numpy >= 2.4)
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    y = dot_rows(X, W, rows, row_ok, stride_w, K, BLOCK_N, BLOCK_K, PDL) * rstd_from(SS, eps, K, HAS_NORM)
    if HAS_BIAS:
        y += tl.load(BIAS + rows, mask=row_ok, other=0.0).to(tl.float32)
    # rounded to x's dtype first: a float32 output holds exactly what a 16-bit product would
    y = y.to(X.dtype.element_ty).to(Y.dtype.element_ty)
    tl.store(Y + rows, y, mask=row_ok)


def k_launch(k: int, block_k: int = _BLOCK_K, device: torch.device | None = None) -> dict:
    """Launch options of a K-column walk: BLOCK_K (at most `block_k` columns a step), 3 pipeline
    stages for long K (`down`'s 14336) and 1 elsewhere (the sweep in the module docstring), and
    Programmatic Dependent Launch where `device` supports it (`kestrel.kernels._utils.pdl`): the kernel's
    PDL constexpr and Triton's `launch_pdl` together."""
    use = device is not None and pdl(device)
    return {"BLOCK_K": min(block_k, max(16, triton.next_power_of_2(k))), "num_stages": 3 if k >= 8192 else 1,
            **pdl_launch(use)}


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """True when the kernel takes this product: one row of x, unit column strides, one dtype,
    and the Triton kernels chosen (`kestrel.kernels.dispatch`: CUDA tensors, or forced)."""
    return (
        x.numel() == x.shape[-1] and x.is_contiguous() and weight.dim() == 2 and weight.stride(1) == 1
        and x.dtype == weight.dtype and (bias is None or (bias.is_contiguous() and bias.dtype == x.dtype))
        and use_triton(x, weight)
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x (..., K) holding one row, weight (N, K), bias (N,) or None -> (..., N). No checks.

    norm = (ss, eps): x is w * v of an RMSNorm whose sum of squares ss ((1,) float32) is given,
    and the product is scaled by rsqrt(ss / K + eps) (see `gemv_fused.py`).
    out_dtype: float32 to widen the x-dtype-rounded result in the same launch."""
    n, k = weight.shape
    y = torch.empty((*x.shape[:-1], n), dtype=out_dtype or x.dtype, device=x.device)
    block_n = _INTERPRETED_BLOCK_N if interpreted() else _BLOCK_N
    ss, eps = norm if norm is not None else (y, 0.0)  # y: a placeholder never read
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y if bias is None else bias, y, ss, n, weight.stride(0), float(eps),
        K=k, HAS_BIAS=bias is not None, HAS_NORM=norm is not None, BLOCK_N=block_n,
        num_warps=_WARPS, **k_launch(k, device=x.device),
    )
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); a one-row x runs the Triton kernel where `gemv_applies`."""
    if gemv_applies(x, weight, bias):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
