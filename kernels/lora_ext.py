"""LoRA folded into the base product's reduction dimension, for NF4 base weights.

For projections k = 1..n of one input X (M, H) (gate and up of an MLP), ranks r_k, R = sum r_k,
scalings s_k, outputs out_k, O = sum out_k:

    X_ext = [X | s_1 X A_1^T | ... | s_n X A_n^T]                    (M, H + R)   `copy_shrink`
    W_ext = rows of projection k: [W_k | 0 .. B_k .. 0]               (O, H + R)   `weight_ext`
    Y     = X_ext W_ext^T = [X W_k^T + s_k (X A_k^T) B_k^T]_k        (M, O)       ONE product

and in backward, for dY = [dY_1 | ... | dY_n] (M, O):

    dX_ext = dY W_ext = [sum_k dY_k W_k | dY_1 B_1 | ... | dY_n B_n] (M, H + R)  ONE product

so the input gradient's product also yields every dY_k B_k (see `kernels.lora._LoRAMLP`).

Why: with the adapter term added separately, each projection's (M, out) expansion s X A^T B^T
is written to memory and read back by the base product's epilogue, and dY B is a separate pass
over dY; at the 8B MLP's (4096 x 14336) outputs that is ~150 us a layer per forward pass. Here
the adapter costs R / H more product work (0.8% at r = 16, H = 4096) and one extra write of X
(the copy into X_ext, fused with the shrink product that reads X anyway).

W_ext lives in the NF4 workspace (`kernels.nf4.WORKSPACE`): the W_k are dequantized straight
into its row blocks (a strided output, rows H + R apart) and the B_k copied into its last R
columns. With `KESTREL_LORA_EXT=own` it gets a buffer of its own, so a checkpointed layer's
backward finds the weights its recompute just built and skips dequantizing them again.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from kernels import nf4
from kernels._launch import launch
from kernels.dispatch import use_triton

_BM, _BK = 32, 128  # rows per program; columns of X per step of the shrink's reduction


def mode() -> str:
    """`KESTREL_LORA_EXT`: "shared" (default: W_ext in the NF4 workspace), "own" (a buffer of its
    own, reused between a layer's recompute and backward), or "off" (adapter added separately)."""
    value = os.environ.get("KESTREL_LORA_EXT", "shared").strip().lower() or "shared"
    if value not in ("shared", "own", "off"):
        raise ValueError(f"KESTREL_LORA_EXT={value!r}: use shared, own or off")
    return value


def usable(weights: Sequence[torch.Tensor], quant_states: Sequence[Any], in_features: int) -> bool:
    """True when every base weight is NF4 and its quant blocks tile the rows of W_ext (each row
    of H elements a whole number of blocks), so the dequantization can write rows H + R apart."""
    if mode() == "off":
        return False
    for w, qs in zip(weights, quant_states):
        if qs is None or w.dtype != torch.uint8 or in_features % int(qs.blocksize):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# X_ext = [X | X A_s^T]: one pass over X.


@triton.jit
def _copy_shrink_kernel(
    OUT, out_row_stride, X, x_row_stride, A, S, n_rows, R,
    H: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, PRECISION: tl.constexpr,
):
    """OUT[:, :H] = X; OUT[:, H:H+R] = (X A^T) * S (fp32 accumulation, one rounding).
    X (n_rows, H) rows x_row_stride apart, A (R, H) contiguous, S (R,) fp32."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    row_ok = rows < n_rows
    ranks = tl.arange(0, RP)
    rank_ok = ranks < R
    acc = tl.zeros((BM, RP), dtype=tl.float32)
    for k0 in range(0, H, BK):
        cols = k0 + tl.arange(0, BK)
        col_ok = cols < H
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
        tl.store(OUT + rows[:, None] * out_row_stride + cols[None, :], x, mask=mask)
        a_t = tl.load(A + ranks[None, :] * H + cols[:, None], mask=rank_ok[None, :] & col_ok[:, None], other=0.0)
        # float32 operands: 16-bit x and A are exact in TF32 (and Triton's interpreter gets
        # bf16 tl.dot wrong); float32 inputs get IEEE products.
        acc = tl.dot(x.to(tl.float32), a_t.to(tl.float32), acc, input_precision=PRECISION)
    acc = acc * tl.load(S + ranks, mask=rank_ok, other=0.0)[None, :]
    tl.store(OUT + rows[:, None] * out_row_stride + H + ranks[None, :], acc.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & rank_ok[None, :])


@functools.lru_cache(maxsize=256)
def _column_scales(ranks: tuple[int, ...], scales: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """(R,) fp32: s_k repeated r_k times (made once per adapter layout and device)."""
    values = [s for r, s in zip(ranks, scales) for _ in range(r)]
    return torch.tensor(values, dtype=torch.float32, device=device)


def copy_shrink(
    x: torch.Tensor, a: torch.Tensor, ranks: Sequence[int], scales: Sequence[float]
) -> torch.Tensor:
    """x (M, H) rows with unit column stride, a = [A_1; ...; A_n] (R, H) in x's dtype ->
    X_ext (M, H + R) = [x | s_1 x A_1^T | ... | s_n x A_n^T], contiguous."""
    m, h = x.shape
    r = a.shape[0]
    out = torch.empty((m, h + r), dtype=x.dtype, device=x.device)
    if not use_triton(x, a):
        out[:, :h].copy_(x)
        torch.mm(x, a.t(), out=out[:, h:])
        _scale_columns_(out[:, h:], ranks, scales)
        return out
    s = _column_scales(tuple(ranks), tuple(float(v) for v in scales), x.device)
    rp = max(16, triton.next_power_of_2(r))
    a = a if a.is_contiguous() else a.contiguous()
    launch(_copy_shrink_kernel, (triton.cdiv(m, _BM),), out, out.stride(0), x, x.stride(0), a, s, m, r,
           h, _BM, _BK, rp, "ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return out


def _scale_columns_(t: torch.Tensor, ranks: Sequence[int], scales: Sequence[float]) -> torch.Tensor:
    """Scale t's column block k (r_k columns) by s_k, in place."""
    if all(s == scales[0] for s in scales):
        return t.mul_(scales[0])
    start = 0
    for r, s in zip(ranks, scales):
        t[:, start : start + r].mul_(s)
        start += r
    return t


# ---------------------------------------------------------------------------------------------
# W_ext: the dequantized bases with the B_k beside them.


class _Built:
    """What W_ext of the "own" buffer holds: the weights and B's it was built from (weakly) and
    each B's version, so a rebuild is skipped only when nothing changed."""

    def __init__(self, buf: torch.Tensor, weights: Sequence[torch.Tensor], bs: Sequence[torch.Tensor]) -> None:
        self.buffer = weakref.ref(_storage_owner(buf))  # a cleared or regrown workspace is a new tensor
        self.refs = [weakref.ref(t) for t in (*weights, *bs)]
        self.versions = [b._version for b in bs]
        self.shape = tuple(buf.shape)

    def matches(self, buf: torch.Tensor, weights: Sequence[torch.Tensor], bs: Sequence[torch.Tensor]) -> bool:
        tensors = (*weights, *bs)
        return (
            self.buffer() is _storage_owner(buf)
            and tuple(buf.shape) == self.shape
            and len(tensors) == len(self.refs)
            and all(ref() is t for ref, t in zip(self.refs, tensors))
            and [b._version for b in bs] == self.versions
        )


def _storage_owner(view: torch.Tensor) -> torch.Tensor:
    return view if view._base is None else view._base


_BUILT: dict[tuple[torch.device, torch.dtype], _Built] = {}
_SLOT = "lora_ext"


def weight_ext(
    weights: Sequence[torch.Tensor], quant_states: Sequence[Any], bs: Sequence[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """W_ext (O, H + R) in `dtype`: row block k = [W_k | 0 .. B_k .. 0], B_k in columns
    H + r_1 + ... + r_{k-1} onward. A view of the NF4 workspace, valid until its next use."""
    h = int(quant_states[0].shape[1])
    outs = [int(qs.shape[0]) for qs in quant_states]
    ranks = [b.shape[1] for b in bs]
    device = bs[0].device
    own = mode() == "own"
    buf = nf4.WORKSPACE.get((sum(outs), h + sum(ranks)), device, dtype, _SLOT if own else "")
    built = _BUILT.pop((device, dtype), None)
    if own and built is not None and built.matches(buf, weights, bs):
        _BUILT[(device, dtype)] = built
        return buf
    if len(bs) > 1:
        buf[:, h:].zero_()
    row, col = 0, h
    for w, qs, b, out, r in zip(weights, quant_states, bs, outs, ranks):
        nf4.dequantize(w, qs, out=buf[row : row + out, :h])
        buf[row : row + out, col : col + r].copy_(b)
        row, col = row + out, col + r
    if own:
        _BUILT[(device, dtype)] = _Built(buf, weights, bs)
    return buf


def forget() -> None:
    """Drop what the own buffer is known to hold (tests; after freeing the workspace)."""
    _BUILT.clear()
