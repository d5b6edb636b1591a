"""The LoRA MLP's GLU passes with the adapters' rank-r products over (M, I) tensors folded in.

In the LoRA MLP (`kernels.mlp`), h = act(E) * G with E = gate(X), G = up(X), all (M, I), and
several adapter terms are skinny products that read a whole (M, I) tensor for 2 r FLOPs an
element (117 MB each at 4,096 x 14,336 bf16, bound by memory):

    forward   s_d h A_d^T                 (M, r)    down's shrink      reads h
    backward  dA_d = dYB_d^T h            (r, I)    down's A gradient  reads h
              dB_g = dE^T xa_g            (I, r)    gate's B gradient  reads dE
              dB_u = dG^T xa_u            (I, r)    up's B gradient    reads dG

with dYB_d = s_d dY B_d (M, r), xa_g = s_g X A_g^T, xa_u = s_u X A_u^T (M, r). The GLU's own
passes read E and G anyway, so here they form these products from the tiles already in
registers (on tensor cores, fp32 sums) and no product re-reads an (M, I) tensor:

- `glu_shrink(E, G, A_d, s_d)` -> s_d h A_d^T (M, r), h formed tile by tile and never written.
  For a checkpoint's recompute, whose down product is skipped: there h has no other use.
- `glu_lora_backward(dh, E, G, xa, dYB_d)` -> dE, dG written over E, G (as `kernels.glu`'s
  in-place backward), and dB_g (I, r_g), dB_u (I, r_u), dA_d (r_d, I) in fp32, with h
  recomputed from E and G (so it need not be kept from the forward):

      h  = act(E) * G          dG = dh * act(E)          dE = dh * G * act'(E)

  rounded to E's dtype as `kernels.glu` rounds them (act first, as HF does), and the products
  over those rounded values, as cuBLAS would form them from the stored tensors.

Grids: `glu_shrink` gives each program BM rows and a share of the I columns (the shares' (M, r)
fp32 partial sums added afterwards); `glu_lora_backward` gives each program BI columns and a
share of the rows, its three (BI, r) sums in registers, written once per program into a
(row groups, 3, I, r) fp32 partial buffer that is summed afterwards (a few MB; no atomics, the
result does not depend on scheduling). Trip counts are compile-time constants (the interpreter
cannot loop to a runtime bound), coarsely rounded so few distinct values occur.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import triton
import triton.language as tl

from kernels._launch import launch
from kernels._utils import cdiv, interpreted, next_pow2, round_up_coarse, sm_count
from kernels.glu import _act_and_grad, geglu_reference, glu_backward_reference, swiglu_reference

Activation = Literal["swiglu", "geglu"]

# Tiles, measured on an H100 at the Llama-8B MLP (bench/glu_lora.py).
_SHRINK_BM, _SHRINK_BI, _SHRINK_WARPS = 64, 64, 4
_BWD_BM, _BWD_BI, _BWD_WARPS, _BWD_TRANSPOSED = 32, 64, 4, False
_PROGRAMS_PER_SM = 4
_STAGES = 2
_BWD_STAGES = 3


@triton.jit
def _dot(x, y, acc, DOT16: tl.constexpr):
    """acc + x @ y: 16-bit operands on tensor cores, or the same values in exact fp32 (fp32
    inputs; and the interpreter, which gets 16-bit tl.dot wrong)."""
    if DOT16:
        out = tl.dot(x, y, acc)
    else:
        out = tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")
    return out


@triton.jit
def _glu_shrink_kernel(
    E, G, A, PART, n_rows, e_stride, g_stride, R,
    I: tl.constexpr, RP: tl.constexpr, COLS_PER_PROGRAM: tl.constexpr, GELU: tl.constexpr,
    BM: tl.constexpr, BI: tl.constexpr, DOT16: tl.constexpr, STAGES: tl.constexpr,
):
    # grid (cdiv(n_rows, BM), column shares): PART[q, rows] = h[rows, share q] A[:, share q]^T
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    row_ok = rows < n_rows
    ranks = tl.arange(0, RP)
    first = tl.program_id(1) * COLS_PER_PROGRAM
    acc = tl.zeros((BM, RP), dtype=tl.float32)
    for start in tl.range(0, COLS_PER_PROGRAM, BI, num_stages=STAGES):
        cols = first + start + tl.arange(0, BI)
        mask = row_ok[:, None] & (cols < I)[None, :]
        e = tl.load(E + rows[:, None] * e_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + rows[:, None] * g_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        act, _ = _act_and_grad(e, GELU)
        h = (act.to(E.dtype.element_ty).to(tl.float32) * g).to(E.dtype.element_ty)  # 0 where masked
        a = tl.load(A + ranks[:, None] * I + cols[None, :], mask=(ranks < R)[:, None] & (cols < I)[None, :],
                    other=0.0)  # (RP, BI)
        acc = _dot(h, tl.trans(a), acc, DOT16)
    out = PART + (tl.program_id(1) * n_rows + rows[:, None]) * RP + ranks[None, :]
    tl.store(out, acc, mask=row_ok[:, None])


@triton.jit
def _tile_offsets(rows, cols, stride, TRANSPOSED: tl.constexpr):
    """Element offsets of an (M, I) row-major tensor's tile: (BM, BI), or (BI, BM) when
    TRANSPOSED (the dots then take it as it is, with no transpose of registers)."""
    if TRANSPOSED:
        offs = rows[None, :] * stride + cols[:, None]
    else:
        offs = rows[:, None] * stride + cols[None, :]
    return offs


@triton.jit
def _glu_lora_bwd_kernel(
    DH, E, G, XA, DYB, PART, n_rows, dh_stride, e_stride, g_stride, xa_stride, dyb_stride,
    R_G, R_U, R_D,
    I: tl.constexpr, RP: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, GELU: tl.constexpr,
    BM: tl.constexpr, BI: tl.constexpr, DOT16: tl.constexpr, STAGES: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    # grid (row groups, cdiv(I, BI)); program (p, c) owns columns c BI.. and rows
    # [p ROWS_PER_PROGRAM, (p + 1) ROWS_PER_PROGRAM), walked BM at a time. E, G are read before
    # this same program writes dE, dG over them.
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    col_ok = cols < I
    ranks = tl.arange(0, RP)
    first = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM
    acc_g = tl.zeros((BI, RP), dtype=tl.float32)
    acc_u = tl.zeros((BI, RP), dtype=tl.float32)
    acc_d = tl.zeros((BI, RP), dtype=tl.float32)
    for start in tl.range(0, ROWS_PER_PROGRAM, BM, num_stages=STAGES):
        rows = first + start + tl.arange(0, BM)
        row_ok = rows < n_rows
        if TRANSPOSED:
            mask = col_ok[:, None] & row_ok[None, :]
        else:
            mask = row_ok[:, None] & col_ok[None, :]
        e_offs = _tile_offsets(rows, cols, e_stride, TRANSPOSED)
        g_offs = _tile_offsets(rows, cols, g_stride, TRANSPOSED)
        dh = tl.load(DH + _tile_offsets(rows, cols, dh_stride, TRANSPOSED), mask=mask, other=0.0).to(tl.float32)
        e = tl.load(E + e_offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + g_offs, mask=mask, other=0.0).to(tl.float32)
        act, dact = _act_and_grad(e, GELU)
        act = act.to(E.dtype.element_ty).to(tl.float32)
        h = (act * g).to(E.dtype.element_ty)
        dg = (dh * act).to(E.dtype.element_ty)
        de = (dh * g * dact).to(E.dtype.element_ty)
        tl.store(E + e_offs, de, mask=mask)
        tl.store(G + g_offs, dg, mask=mask)
        xa = XA + rows[:, None] * xa_stride + ranks[None, :]
        xg = tl.load(xa, mask=row_ok[:, None] & (ranks < R_G)[None, :], other=0.0)  # (BM, RP)
        xu = tl.load(xa + R_G, mask=row_ok[:, None] & (ranks < R_U)[None, :], other=0.0)
        yd = tl.load(DYB + rows[:, None] * dyb_stride + ranks[None, :],
                     mask=row_ok[:, None] & (ranks < R_D)[None, :], other=0.0)
        if TRANSPOSED:
            acc_g = _dot(de, xg, acc_g, DOT16)
            acc_u = _dot(dg, xu, acc_u, DOT16)
            acc_d = _dot(h, yd, acc_d, DOT16)
        else:
            acc_g = _dot(tl.trans(de), xg, acc_g, DOT16)
            acc_u = _dot(tl.trans(dg), xu, acc_u, DOT16)
            acc_d = _dot(tl.trans(h), yd, acc_d, DOT16)
    out = PART + (tl.program_id(0) * 3 * I + cols[:, None]) * RP + ranks[None, :]
    tl.store(out, acc_g, mask=col_ok[:, None])
    tl.store(out + I * RP, acc_u, mask=col_ok[:, None])
    tl.store(out + 2 * I * RP, acc_d, mask=col_ok[:, None])


def _rank_pad(*ranks: int) -> int:
    return max(16, next_pow2(max(ranks)))


@functools.lru_cache(maxsize=256)
def _shrink_plan(n_rows: int, inter: int, device: torch.device) -> tuple[int, int]:
    """(column shares, columns per share): enough programs to fill the GPU at this row count."""
    row_tiles = cdiv(n_rows, _SHRINK_BM)
    col_tiles = cdiv(inter, _SHRINK_BI)
    shares = max(1, min(col_tiles, cdiv(_PROGRAMS_PER_SM * sm_count(device), row_tiles)))
    per_share = round_up_coarse(cdiv(col_tiles, shares)) * _SHRINK_BI
    return cdiv(inter, per_share), per_share


@functools.lru_cache(maxsize=256)
def _bwd_plan(n_rows: int, inter: int, device: torch.device) -> tuple[int, int]:
    """(row groups, rows per group)."""
    row_tiles = max(1, cdiv(n_rows, _BWD_BM))
    col_tiles = cdiv(inter, _BWD_BI)
    groups = max(1, min(row_tiles, cdiv(_PROGRAMS_PER_SM * sm_count(device), col_tiles)))
    per_group = round_up_coarse(cdiv(row_tiles, groups)) * _BWD_BM
    return cdiv(n_rows, per_group), per_group


def _dot16(t: torch.Tensor) -> bool:
    """16-bit tensor-core products for 16-bit inputs when compiled; exact fp32 otherwise (fp32
    inputs would otherwise get TF32)."""
    return t.dtype in (torch.bfloat16, torch.float16) and not interpreted()


def _rows_ok(*ts: torch.Tensor) -> bool:
    return all(t.dim() == 2 and t.stride(1) == 1 for t in ts)


def glu_shrink(
    e: torch.Tensor, g: torch.Tensor, a: torch.Tensor, scaling: float, activation: Activation
) -> torch.Tensor:
    """s h A^T (M, r) in e's dtype, h = act(e) * g never written. e, g (M, I) with unit column
    stride; a (r, I) contiguous in e's dtype. Triton only (the caller picks the reference)."""
    n_rows, inter = e.shape
    r = a.shape[0]
    if not _rows_ok(e, g) or not a.is_contiguous():
        raise ValueError("glu_shrink needs rows with unit column stride and a contiguous A")
    rp = _rank_pad(r)
    shares, per_share = _shrink_plan(n_rows, inter, e.device)
    part = torch.empty((shares, n_rows, rp), dtype=torch.float32, device=e.device)
    if n_rows > 0:
        launch(_glu_shrink_kernel, (cdiv(n_rows, _SHRINK_BM), shares), e, g, a, part, n_rows, e.stride(0),
               g.stride(0), r, inter, rp, per_share, activation == "geglu", _SHRINK_BM, _SHRINK_BI,
               _dot16(e), _STAGES, num_warps=_SHRINK_WARPS)
    total = part[0] if shares == 1 else part.sum(0)
    return total[:, :r].mul_(scaling).to(e.dtype)


def glu_lora_backward(
    dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor, xa: torch.Tensor, r_g: int, dyb: torch.Tensor,
    activation: Activation,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dE, dG, dB_g, dB_u, dA_d) (module docstring). dh, e, g (M, I); xa = [xa_g | xa_u]
    (M, r_g + r_u); dyb = dYB_d (M, r_d); all in e's dtype with unit column stride. dE, dG are
    written over e, g (their version counters bumped); dB_g (I, r_g), dB_u (I, r_u) and
    dA_d (r_d, I) are fp32."""
    n_rows, inter = e.shape
    r_u, r_d = xa.shape[1] - r_g, dyb.shape[1]
    if not _rows_ok(dh, e, g, xa, dyb):
        raise ValueError("glu_lora_backward needs rows with unit column stride")
    rp = _rank_pad(r_g, r_u, r_d)
    groups, per_group = _bwd_plan(n_rows, inter, e.device)
    part = torch.empty((groups, 3, inter, rp), dtype=torch.float32, device=e.device)
    if n_rows > 0:
        launch(_glu_lora_bwd_kernel, (groups, cdiv(inter, _BWD_BI)), dh, e, g, xa, dyb, part, n_rows,
               dh.stride(0), e.stride(0), g.stride(0), xa.stride(0), dyb.stride(0), r_g, r_u, r_d, inter, rp,
               per_group, activation == "geglu", _BWD_BM, _BWD_BI, _dot16(e), _BWD_STAGES, _BWD_TRANSPOSED,
               num_warps=_BWD_WARPS)
    else:
        part.zero_()
    torch.autograd.graph.increment_version(e)
    torch.autograd.graph.increment_version(g)
    total = part[0] if groups == 1 else part.sum(0)  # (3, I, rp)
    return e, g, total[0, :, :r_g], total[1, :, :r_u], total[2, :, :r_d].t()


def glu_shrink_reference(
    e: torch.Tensor, g: torch.Tensor, a: torch.Tensor, scaling: float, activation: Activation
) -> torch.Tensor:
    """`glu_shrink` in torch: h as `kernels.glu` rounds it, then the fp32 product."""
    h = (swiglu_reference if activation == "swiglu" else geglu_reference)(e, g)
    return (h.float() @ a.float().t() * scaling).to(e.dtype)


def glu_lora_backward_reference(
    dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor, xa: torch.Tensor, r_g: int, dyb: torch.Tensor,
    activation: Activation,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`glu_lora_backward` in torch, from the separate GLU backward and fp32 products."""
    h = (swiglu_reference if activation == "swiglu" else geglu_reference)(e, g)
    da_d = dyb.float().t() @ h.float()
    de, dg = glu_backward_reference(e, g, dh, activation)
    xf = xa.float()
    return de, dg, de.float().t() @ xf[:, :r_g], dg.float().t() @ xf[:, r_g:], da_d
