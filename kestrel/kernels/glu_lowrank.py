"""The GLU of a LoRA MLP over a 16-bit base, with the adapters' rank-r terms added inside it.

With E = X W_g^T and G = X W_u^T the base products (M, I), U_e = s_g X A_g^T and U_g = s_u X A_u^T
the shrink products (M, r) and V_e = B_g, V_g = B_u (I, r), the MLP's gated unit is

    E' = E + U_e V_e^T          G' = G + U_g V_g^T          (fp32, never stored)
    h  = act(E') * G'           act(E') rounded to E's dtype first, as HF (`kestrel.kernels.glu`)

and its backward, given dh (M, I), writes over E and G (nothing new the size of E):

    dE = dh * G' * act'(E')     dG = dh * act(E')

dE and dG are the gradients of E' and G' (so of the adapters' expansions too): the caller forms the
adapter gradients and dX from them as before (`kestrel.kernels.lora.mlp`).

Why: unmerged, each expansion U V^T is a pass of its own over an (M, I) output (written, then read
again by the base product that accumulates onto it), 4 M I bytes for gate and as many for up in
each of the first pass and the recompute, about 3% of a long 16-bit step, which a merged NF4
base does not pay (bench/RESULTS.md, session 40). Here the expansions are rank-r dot products
inside the pass the GLU makes anyway: their operands, an (M, r) and an (I, r) tile, are small
against the (M, I) tiles it reads and writes. E' is added in fp32 and never rounded, one rounding
less than the adapter-first product, whose output is rounded to 16 bits.

Layout: E, G, dh (M, I) with any row stride and unit column stride (`as_rows`); U (M, r) and V (I, r)
likewise (U may be a column slice of the group's (M, 2r) shrink product). E and G are the rank dots'
accumulators (the rank is summed in steps of at most 32; the ranks are compile-time constants, so U's
and V's rows load as wide vectors). Programs tile (rows, columns) in 16 x 128 blocks at 4 warps, one
row block a program (`Tiles`; a program may take several in turn, reading its V tiles once where the
rank is one dot step: to be swept). 16 x 128 was the fastest of 40 tilings swept over three (M, I)
shapes, 1.38x the plain GLU's forward-plus-backward time where the first 64 x 128 tiles at 8 warps
took 1.92x; that sweep ran before the rank loads were wide (`bench/glu_lowrank_tiles.py`;
bench/RESULTS.md, session 41).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kestrel.kernels._launch import launch
from kestrel.kernels._utils import as_rows
from kestrel.kernels.dispatch import use_triton
from kestrel.kernels.glu import _act_and_grad, act_and_grad_reference, glu_grads_reference



class Tiles(NamedTuple):
    """A launch's tiling: (rows, columns) of a program's tile, its warps, and how many such row blocks one
    program takes in turn under its column block (module docstring: Layout)."""

    rows: int = 16
    cols: int = 128
    warps: int = 4
    row_steps: int = 1


DEFAULT_TILES = Tiles()
_MAX_STEP = 32  # rank columns per dot: a (64 + 128) x 32 operand pair fits the registers


@triton.jit
def _dot(acc, u, v, IEEE: tl.constexpr):
    """acc + u v^T: u (BM, STEP), v (BN, STEP), acc (BM, BN) fp32."""
    if IEEE:  # fp32 products, not TF32 (fp32 operands, or 16-bit ones under the interpreter)
        return tl.dot(u.to(tl.float32), tl.trans(v.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(u, tl.trans(v), acc)


@triton.jit
def _rank_tile(T, t_stride, idx, idx_mask, K0: tl.constexpr, RANK_T: tl.constexpr, STEP: tl.constexpr):
    """T[idx, K0:K0 + STEP] of T (n, RANK_T), zero past the rank and outside idx_mask. The rank is a compile-time
    constant, so a step inside it is masked by row alone and one past it by a known column bound: either way a
    row's elements load as wide vectors (a run-time rank's column mask made each element a 2-byte load of its
    own; bench/RESULTS.md, session 41)."""
    k = K0 + tl.arange(0, STEP)
    if K0 + STEP <= RANK_T:
        return tl.load(T + idx[:, None] * t_stride + k[None, :], mask=idx_mask[:, None], other=0.0)
    return tl.load(T + idx[:, None] * t_stride + k[None, :], mask=idx_mask[:, None] & (k[None, :] < RANK_T), other=0.0)


@triton.jit
def _expansion(acc, U, u_stride, V, v_stride, rows, cols, row_mask, col_mask,
               RANK_T: tl.constexpr, STEP: tl.constexpr, IEEE: tl.constexpr):
    """acc + U[rows] V[cols]^T, a (BM, BN) fp32 tile, of U (M, RANK_T), V (N, RANK_T), summed in steps of STEP
    (a power of two of at least 16, tl.dot's least)."""
    for k0 in tl.static_range(0, RANK_T, STEP):
        u = _rank_tile(U, u_stride, rows, row_mask, k0, RANK_T, STEP)
        acc = _dot(acc, u, _rank_tile(V, v_stride, cols, col_mask, k0, RANK_T, STEP), IEEE)
    return acc


@triton.jit
def _glu_kernel(
    X, x_stride, E, e_stride, G, g_stride, UE, ue_stride, UG, ug_stride, VE, ve_stride, VG, vg_stride,
    n_rows, n_cols,
    GELU: tl.constexpr, BACKWARD: tl.constexpr, RANK_E: tl.constexpr, RANK_G: tl.constexpr, STEP: tl.constexpr,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, ROW_STEPS: tl.constexpr,
):
    """Forward: h = act(E') * G' into X. BACKWARD: dE', dG' from dh (read from X) over E and G: every element
    is read before it is written, by the same program. A program takes ROW_STEPS row blocks of BM rows under
    one block of BN columns; where each rank is one dot step, it reads that block's V_e and V_g tiles once."""
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_mask = cols < n_cols
    ONE_STEP: tl.constexpr = RANK_E <= STEP and RANK_G <= STEP
    if ONE_STEP:
        ve = _rank_tile(VE, ve_stride, cols, col_mask, 0, RANK_E, STEP)
        vg = _rank_tile(VG, vg_stride, cols, col_mask, 0, RANK_G, STEP)
    for step in range(ROW_STEPS):
        rows = ((tl.program_id(0) * ROW_STEPS + step) * BM + tl.arange(0, BM)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        e = tl.load(E + rows[:, None] * e_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + rows[:, None] * g_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ONE_STEP:  # E' = E + U_e V_e^T, G' = G + U_g V_g^T, in fp32: E and G are the dots' accumulators
            e = _dot(e, _rank_tile(UE, ue_stride, rows, row_mask, 0, RANK_E, STEP), ve, IEEE)
            g = _dot(g, _rank_tile(UG, ug_stride, rows, row_mask, 0, RANK_G, STEP), vg, IEEE)
        else:
            e = _expansion(e, UE, ue_stride, VE, ve_stride, rows, cols, row_mask, col_mask, RANK_E, STEP, IEEE)
            g = _expansion(g, UG, ug_stride, VG, vg_stride, rows, cols, row_mask, col_mask, RANK_G, STEP, IEEE)
        act, dact = _act_and_grad(e, GELU)
        act = act.to(E.dtype.element_ty).to(tl.float32)  # HF: act_fn(gate) is in gate's dtype
        if BACKWARD:
            dh = tl.load(X + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(E + rows[:, None] * e_stride + cols[None, :], (dh * g * dact).to(E.dtype.element_ty), mask=mask)
            tl.store(G + rows[:, None] * g_stride + cols[None, :], (dh * act).to(G.dtype.element_ty), mask=mask)
        else:
            tl.store(X + rows[:, None] * x_stride + cols[None, :], (act * g).to(X.dtype.element_ty), mask=mask)


def _rank_step(rank: int) -> int:
    """Rank columns a dot takes: a power of two in 16..32 (tl.dot's least K is 16; at 32 a (64 + 128) x 32
    operand pair still fits the registers), the rank's own when it is smaller."""
    return min(_MAX_STEP, max(16, triton.next_power_of_2(rank)))


def _operands(e: torch.Tensor, g: torch.Tensor, us: tuple[torch.Tensor, torch.Tensor],
              vs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """E, G as rows; U_e, U_g, V_e, V_g as (rows, r) with unit column stride, V in U's dtype (gate's rank r_e
    and up's r_g may differ)."""
    if e.shape != g.shape:
        raise ValueError(f"gate {tuple(e.shape)} and up {tuple(g.shape)} must have one shape")
    ue, ug = (as_rows(u) for u in us)
    ve, vg = (as_rows(v.to(ue.dtype)) for v in vs)
    rows, cols = e.numel() // max(e.shape[-1], 1), e.shape[-1]
    for name, t, shape in (("U_e", ue, (rows, ue.shape[1])), ("U_g", ug, (rows, ug.shape[1])),
                           ("V_e", ve, (cols, ue.shape[1])), ("V_g", vg, (cols, ug.shape[1]))):
        if t.shape != shape or ug.dtype != ue.dtype:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} is not {shape} {ue.dtype}")
    return as_rows(e), as_rows(g), ue, ug, ve, vg


def _launch(backward: bool, first: torch.Tensor, e: torch.Tensor, g: torch.Tensor, ue: torch.Tensor,
            ug: torch.Tensor, ve: torch.Tensor, vg: torch.Tensor, gelu: bool, tiles: Tiles) -> None:
    """`_glu_kernel` over E and G, `first` being h (forward) or dh (backward)."""
    n_rows, n_cols = e.shape
    step = _rank_step(max(ue.shape[1], ug.shape[1]))
    grid = (triton.cdiv(n_rows, tiles.rows * tiles.row_steps), triton.cdiv(n_cols, tiles.cols))
    launch(_glu_kernel, grid, first, first.stride(0), e, e.stride(0), g, g.stride(0), ue, ue.stride(0), ug, ug.stride(0),
           ve, ve.stride(0), vg, vg.stride(0), n_rows, n_cols, gelu, backward, ue.shape[1], ug.shape[1], step,
           ue.dtype == torch.float32 or _interpreted(), tiles.rows, tiles.cols, tiles.row_steps, num_warps=tiles.warps)


def _interpreted() -> bool:
    """Whether Triton runs its interpreter: its dot multiplies 16-bit floats wrongly (NumPy has no
    bfloat16), so 16-bit operands go up to fp32 there (exact: a 16-bit product fits fp32)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def primed_reference(e: torch.Tensor, g: torch.Tensor, us: tuple[torch.Tensor, torch.Tensor],
                     vs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(E', G') in fp32: E + U_e V_e^T, G + U_g V_g^T."""
    return (e.float() + us[0].float() @ vs[0].float().t(), g.float() + us[1].float() @ vs[1].float().t())


def glu_lowrank(e: torch.Tensor, g: torch.Tensor, us: tuple[torch.Tensor, torch.Tensor],
                vs: tuple[torch.Tensor, torch.Tensor], gelu: bool, tiles: Tiles = DEFAULT_TILES) -> torch.Tensor:
    """h = act(E + U_e V_e^T) * (G + U_g V_g^T) (M, I) in E's dtype (module docstring). e, g (M, I);
    us = (U_e, U_g), each (M, r); vs = (V_e, V_g), each (I, r). No autograd: `glu_lowrank_backward_`."""
    e2, g2, ue, ug, ve, vg = _operands(e, g, us, vs)
    if not use_triton(e2, g2, ue):
        ep, gp = primed_reference(e2, g2, (ue, ug), (ve, vg))
        act = act_and_grad_reference(ep, gelu)[0].to(e.dtype).float()
        return (act * gp).to(e.dtype).view(e.shape)
    h = torch.empty(e2.shape, dtype=e.dtype, device=e.device)
    if h.numel() > 0:
        _launch(False, h, e2, g2, ue, ug, ve, vg, gelu, tiles)
    return h.view(e.shape)


def glu_lowrank_backward_(dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor, us: tuple[torch.Tensor, torch.Tensor],
                          vs: tuple[torch.Tensor, torch.Tensor], gelu: bool,
                          tiles: Tiles = DEFAULT_TILES) -> tuple[torch.Tensor, torch.Tensor]:
    """(dE', dG') of h = act(E') * G' given dh (M, I), written over e and g and returned (module docstring)."""
    e2, g2, ue, ug, ve, vg = _operands(e, g, us, vs)
    dh2 = as_rows(dh)
    if dh2.shape != e2.shape:
        raise ValueError(f"dh {tuple(dh.shape)} is not E's {tuple(e.shape)}")
    if not use_triton(e2, g2, ue):
        de, dg = glu_grads_reference(*primed_reference(e2, g2, (ue, ug), (ve, vg)), dh2.float(), gelu, e.dtype)
        e2.copy_(de)
        g2.copy_(dg)
    elif e2.numel() > 0:
        _launch(True, dh2, e2, g2, ue, ug, ve, vg, gelu, tiles)
    for t, rows in ((e, e2), (g, g2)):
        if rows.data_ptr() != t.data_ptr():  # `as_rows` had to copy: the gradients go back where asked
            t.copy_(rows.view(t.shape))
    return e, g
