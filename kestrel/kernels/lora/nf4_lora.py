"""NF4 dequantization with the LoRA update merged in: W' = W + s B A, in one pass.

For a projection with an NF4 base W (out, in), adapter A (r, in), B (out, r) and scaling s,

    y = x W^T + s (x A^T) B^T = x (W + s B A)^T          and     dx = dy (W + s B A)

so once W' = W + s B A is formed, the forward is ONE plain product and the input gradient ONE
plain product: no (M, out) adapter expansion is written and read back, no shrink product is
needed when nothing will be back-propagated, and no dyb A term is added to dx. W has to be
dequantized into a 16-bit workspace anyway; adding s B A there costs a rank-r `tl.dot` per
output tile (2 r FLOPs an element, on tensor cores), not a pass over memory.

Rounding: W' is rounded to the compute dtype once, from fp32 (dequantized value + s (B A)),
so the adapter's contribution is rounded at W's bf16 resolution -- the same resolution the
base weight itself already has in the product. With B = 0 (a fresh adapter) W' is bit for bit
the plain dequantization. The adapter gradients do not use W' (`kestrel.kernels.lora.lora`).

For a 16-bit W' the rank-r product runs on A and B rounded to that 16-bit type (tensor-core
products are exact, sums in fp32): each term is off by at most 2 x 2^-8 of s |B| |A|, well below
the rounding of W' itself wherever |s B A| is small against |W|, which it is for an adapter.

Tiles: a program writes a (BI, BJ) tile of W' (BJ a multiple of the quant block size, so each
row of the tile is whole quant blocks); `usable` says when a shape allows that. BI = 32, BJ = 128,
4 warps, 16-bit operands: the fastest of a sweep over BI in {32, 64, 128}, BJ in {128, 256},
{4, 8} warps and fp32 (TF32) or 16-bit operands (`python bench/nf4_tiles.py`; bench/RESULTS.md,
QLoRA "Session 7").
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kestrel.kernels import nf4
from kestrel.kernels._launch import launch
from kestrel.kernels._utils import interpreted
from kestrel.kernels.nf4 import block_scales, decode_bytes
from kestrel.kernels.dispatch import use_triton

_BI = 32  # output rows per program


@triton.jit
def _nf4_lora_kernel(
    w_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr,  # as nf4._nf4_dequant_kernel
    a_ptr,  # (R, IN) contiguous, any float dtype
    b_ptr,  # (n_rows, R) contiguous
    out_ptr,  # (n_rows, IN) contiguous
    n_rows, scaling, R,
    IN: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
    BI: tl.constexpr, BJ: tl.constexpr, RP: tl.constexpr, OPERANDS16: tl.constexpr, DOT16: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BI + tl.arange(0, BI)  # (BI,)
    row_ok = rows < n_rows
    first = rows * IN + tl.program_id(1) * BJ  # (BI,) flat index of each tile row's first element
    NB: tl.constexpr = BJ // BLOCKSIZE
    blk = first[:, None] // BLOCKSIZE + tl.arange(0, NB)[None, :]  # (BI, NB) quant blocks
    scale = block_scales(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, blk, row_ok[:, None], BLOCKSIZE2, NESTED)
    byte_idx = first[:, None] // 2 + tl.arange(0, BJ // 2)[None, :]  # (BI, BJ / 2)
    packed = tl.load(w_ptr + byte_idx, mask=row_ok[:, None], other=0)
    vals = tl.reshape(decode_bytes(packed, code_ptr), (BI, NB, BLOCKSIZE)) * scale[:, :, None]
    vals = tl.reshape(vals, (BI, BJ))
    ranks = tl.arange(0, RP)
    rank_ok = ranks < R
    cols = tl.program_id(1) * BJ + tl.arange(0, BJ)
    b = tl.load(b_ptr + rows[:, None] * R + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
    a = tl.load(a_ptr + ranks[:, None] * IN + cols[None, :], mask=rank_ok[:, None], other=0.0)
    if OPERANDS16:  # A and B rounded to W's 16-bit type: exact products, fp32 sums
        b, a = b.to(out_ptr.dtype.element_ty), a.to(out_ptr.dtype.element_ty)
    if DOT16:
        delta = tl.dot(b, a)  # (BI, BJ) fp32
    else:  # an fp32 W', or the interpreter (it gets 16-bit tl.dot wrong): the same products in fp32
        delta = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    vals = vals + scaling * delta
    tl.store(out_ptr + rows[:, None] * IN + cols[None, :], vals.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _tile_cols(in_features: int, blocksize: int) -> int:
    """BJ: 128 columns (the fastest), else 256 or 64, dividing a row into whole quant blocks (0: none)."""
    for bj in (128, 256, 64):
        if in_features % bj == 0 and bj % blocksize == 0:
            return bj
    return 0


def usable(quant_state: Any) -> bool:
    """True when W's rows split into tiles of whole quant blocks (`_tile_cols`)."""
    return getattr(quant_state, "quant_type", "nf4") == "nf4" and _tile_cols(
        int(quant_state.shape[1]), int(quant_state.blocksize)
    ) > 0


def merged_reference(
    weight: torch.Tensor, quant_state: Any, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """W + s B A in `dtype`, from fp32 (the dequantized W is exact there), rounded once."""
    dense = nf4.dequantize_reference(weight, quant_state, torch.float32)
    return (dense + scaling * (lora_b.float() @ lora_a.float())).to(dtype)


def dequantize_merged(
    weight: torch.Tensor, quant_state: Any, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
    dtype: torch.dtype, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """W' = W + s B A (out, in) in `dtype`, written into `out` (contiguous, `dtype`) or else the
    shared NF4 workspace (a view valid until the next dequantization on that device and dtype).
    weight/quant_state: a bitsandbytes NF4 weight (`usable` must hold); lora_a (r, in),
    lora_b (out, r) in any float dtype."""
    plan = nf4._plan(weight, quant_state)
    packed = plan.tensors[0]
    out = nf4.output_buffer(plan, out, dtype)
    if not use_triton(packed):
        return out.copy_(merged_reference(weight, quant_state, lora_a, lora_b, scaling, dtype))
    n_rows, in_features = plan.shape
    bj, r = _tile_cols(in_features, plan.blocksize), lora_a.shape[0]
    a = lora_a if lora_a.is_contiguous() else lora_a.contiguous()
    b = lora_b if lora_b.is_contiguous() else lora_b.contiguous()
    grid = (triton.cdiv(n_rows, _BI), in_features // bj)
    operands16 = dtype in (torch.bfloat16, torch.float16)
    dot16 = operands16 and not interpreted()
    launch(_nf4_lora_kernel, grid, *plan.tensors, a, b, out, n_rows, float(scaling), r,
           in_features, plan.blocksize, plan.blocksize2, plan.nested, _BI, bj, max(16, triton.next_power_of_2(r)),
           operands16, dot16, num_warps=4, enable_fp_fusion=False)
    return out
