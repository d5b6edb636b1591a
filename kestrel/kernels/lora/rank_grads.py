"""The two rank-r products of one adapter's backward that read the output gradient, in one pass over it.

For a projection y = x W^T + (x A^T s) B^T with output gradient dy (M, N) (N the projection's outputs,
r its rank) and xa = s x A^T (M, r), kept from the forward, the backward needs

    dyb = dy B          (M, r)     the adapter's path back towards x (and dA = (s dyb)^T x)
    dB  = dy^T xa       (N, r)     B's gradient, accumulated in fp32

Both read all of dy, the largest tensor either touches (M N elements against (M + N) r), and as two
cuBLAS products each reads it once: two passes over dy, by products whose outputs are only r = 8-64
columns wide, which cuBLAS ran several times slower than reading dy takes where N is a hidden size
(bench/RESULTS.md, session 47: the 16-bit LoRA step's rank-r products). Here each program reads one
(BM, BN) tile of dy at a time, once, and feeds it to both products.

Program (g, j) owns columns j BN .. (j + 1) BN of dy and a group of rows, which it walks BM at a time:

    part_j[rows] = dy[rows, cols_j] B[cols_j]        (BM, r): stored, one slab per column block j
    acc_g       += dy[rows, cols_j]^T xa[rows]       (BN, r): in registers over the group's rows

after which acc_g goes to its own slab. The slabs are summed on the host side of the kernel (a
fixed order: the result is the same from run to run, as cuBLAS's is): dyb = sum_j part_j and
dB = sum_g acc_g. The slabs cost 2 r / BN and 2 r / G (G the rows of a group) of dy's bytes to
write, and again to read back, which is why ranks above 32 take the two products (`_one_pass_pays`);
the grid is sized to fill the device twice over (`_grid`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kestrel.kernels._launch import launch
from kestrel.kernels._utils import cdiv, interpreted, next_pow2, round_up_coarse, sm_count
from kestrel.kernels.dispatch import use_triton
from kestrel.kernels.lora.casts import mm_to

_WAVES = 2  # programs per streaming multiprocessor the grid aims at


class Tiles(NamedTuple):
    """A launch's tiling: rows of a step, columns of a program, warps, pipelined stages (`tl.range`: tiles of dy
    copied ahead into shared memory). The default is untimed (compiled for sm_90, pipelined and without spilling:
    `tests/kernels/test_rank_grads.py`); `bench/rank_grads.py --sweep` times it against others."""

    rows: int = 32
    cols: int = 256
    warps: int = 4
    stages: int = 3


DEFAULT_TILES = Tiles()


@triton.jit
def _rank_grads_kernel(
    dy_ptr, b_ptr, xa_ptr,  # dy (M, N), B (N, R), xa (M, R): any strides
    part_ptr,  # (n_col_blocks, M, RP) fp32: dy B, one slab per column block
    acc_ptr,  # (n_row_groups, N, RP) fp32: dy^T xa, one slab per row group
    M, N, R,
    s_dym, s_dyn, s_bn, s_br, s_xam, s_xar,
    STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr, IEEE: tl.constexpr,
    STAGES: tl.constexpr,
):
    g, j = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64 offsets: a transposed dy's
    cols = j * BN + tl.arange(0, BN)  # column stride is M, and slab offsets pass 2^31 on long batches
    col_ok = cols < N
    rk = tl.arange(0, RP)
    rk_ok = rk < R
    b = tl.load(b_ptr + cols[:, None] * s_bn + rk[None, :] * s_br, mask=col_ok[:, None] & rk_ok[None, :], other=0.0)
    acc = tl.zeros((BN, RP), dtype=tl.float32)
    first = g * (STEPS * BM)
    for step in tl.range(0, STEPS, num_stages=STAGES):  # a constant trip count: `_grid` rounds it to few values
        rows = first + step * BM + tl.arange(0, BM)
        row_ok = rows < M
        dy = tl.load(dy_ptr + rows[:, None] * s_dym + cols[None, :] * s_dyn,
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # (BM, BN)
        xa = tl.load(xa_ptr + rows[:, None] * s_xam + rk[None, :] * s_xar,
                     mask=row_ok[:, None] & rk_ok[None, :], other=0.0)  # (BM, RP)
        if IEEE:  # fp32 operands (as cuBLAS multiplies them), or the interpreter (it gets 16-bit tl.dot wrong)
            dy, xa = dy.to(tl.float32), xa.to(tl.float32)
            part = tl.dot(dy, b.to(tl.float32), input_precision="ieee")  # (BM, RP)
            acc = tl.dot(tl.trans(dy), xa, acc, input_precision="ieee")  # (BN, RP)
        else:
            part = tl.dot(dy, b)
            acc = tl.dot(tl.trans(dy), xa, acc)
        tl.store(part_ptr + (j * M + rows[:, None]) * RP + rk[None, :], part, mask=row_ok[:, None])
    tl.store(acc_ptr + (g * N + cols[:, None]) * RP + rk[None, :], acc, mask=col_ok[:, None])


def _grid(m: int, n: int, device: torch.device, tiles: Tiles = DEFAULT_TILES) -> tuple[int, int, int]:
    """(row groups, column blocks, steps of `tiles.rows` rows a group): column blocks of `tiles.cols`, then as many
    row groups as bring the programs to _WAVES a multiprocessor, each group's steps rounded up to three significant
    bits (a compile-time trip count, so few distinct values: `round_up_coarse`)."""
    col_blocks = cdiv(n, tiles.cols)
    steps = cdiv(m, tiles.rows)
    groups = max(1, min(steps, cdiv(_WAVES * sm_count(device), col_blocks)))
    per_group = round_up_coarse(cdiv(steps, groups))
    return cdiv(steps, per_group), col_blocks, per_group


def _one_pass_pays(rp: int, tiles: Tiles = DEFAULT_TILES) -> bool:
    """Whether the one pass moves fewer bytes than cuBLAS's two, at rank columns `rp`: it saves one read of dy and
    adds its dy B slabs, written and read back, 2 x (rp fp32 a row per C columns) = 4 rp / C of dy's 16-bit bytes
    (C = tiles.cols; the dB slabs are smaller by G / C). That is at most half the read it saves up to rp = C / 8
    (32 at 256 columns); at rank 64 the two would be level, and cuBLAS's products are wider there."""
    return 4 * rp <= tiles.cols // 2


def rank_grads_reference(dy: torch.Tensor, b: torch.Tensor, xa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy B in dy's dtype, dy^T xa in fp32) by two products (the module docstring's math)."""
    return torch.mm(dy, b), mm_to(dy.t(), xa, torch.float32)


def rank_grads(
    dy: torch.Tensor, b: torch.Tensor, xa: torch.Tensor, tiles: Tiles = DEFAULT_TILES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dyb = dy B (M, r) in dy's dtype and dB = dy^T xa (N, r) in fp32, for dy (M, N), B (N, r) and xa (M, r)
    of one dtype (any strides): one pass over dy on CUDA (the Triton kernel) where it moves fewer bytes than two
    (`_one_pass_pays`), two products otherwise."""
    m, n = dy.shape
    r = b.shape[1]
    rp = max(16, next_pow2(r))  # tl.dot's smallest side
    if not (use_triton(dy, b, xa) and m and n and dy.dtype == b.dtype == xa.dtype and _one_pass_pays(rp, tiles)):
        return rank_grads_reference(dy, b, xa)
    groups, col_blocks, steps = _grid(m, n, dy.device, tiles)
    part = torch.empty((col_blocks, m, rp), dtype=torch.float32, device=dy.device)
    acc = torch.empty((groups, n, rp), dtype=torch.float32, device=dy.device)
    launch(_rank_grads_kernel, (groups, col_blocks), dy, b, xa, part, acc, m, n, r,
           dy.stride(0), dy.stride(1), b.stride(0), b.stride(1), xa.stride(0), xa.stride(1),
           steps, tiles.rows, tiles.cols, rp, dy.dtype == torch.float32 or interpreted(), tiles.stages,
           num_warps=tiles.warps)
    dyb = (part[0] if col_blocks == 1 else part.sum(0))[:, :r].to(dy.dtype)
    db = (acc[0] if groups == 1 else acc.sum(0))[:, :r]
    return dyb, db.contiguous()
