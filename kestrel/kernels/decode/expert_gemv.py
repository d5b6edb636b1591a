"""A decode step's expert products read straight from the stored experts: no gathered copy.

    y[p, n] = sum_k x[p, k] W[e[p]][k, n]      p < M pairs (token, choice), e (M,) expert ids

A mixture-of-experts decode step (one token a row, N*k pairs) multiplies each pair's row by one
chosen expert's slice. Gathering the slices into an (M, in, out) copy for one batched matmul
writes every chosen slice and reads it back: about 3x the bytes the products need in 16-bit, and
for NF4 experts (`PackedExperts.select`) an int64 index and an fp32 value per chosen weight, ~25
bytes moved per weight against the 0.52 stored. This kernel reads each pair's expert in place:
one program per (pair, output tile), the expert id loaded on the device (no host read, fixed
shapes: capturable in a CUDA graph). An expert chosen by several pairs is read once per pair (the
repeats mostly from L2: their programs run side by side).

Layout: the family's stored (E, a, b), contiguous along b. Qwen3-MoE stores (E, out, in): K is the
contiguous axis (`K_CONTIG`), a tile is (BLOCK_N, BLOCK_K) and sums along its rows. gpt-oss stores
(E, in, out): N is contiguous, a tile is (BLOCK_K, BLOCK_N) and sums down its columns. The flat
offset of element (k, n) inside expert e is e*stride_e + n*stride_n + k*stride_k, with the unit
stride on the contiguous axis known to the compiler (coalesced, vectorised loads).

Weights: 16-bit (or fp32) tensors, or NF4 (`kestrel.kernels.moe.PackedExperts`: bitsandbytes'
layout on the flat (E, a, b) tensor: element 2j in the HIGH nibble of byte j, one absmax per 64
consecutive elements, double-quantised absmax decoded per block in the kernel,
`nf4.block_scales`). NF4 tiles are read as bytes along the contiguous axis (its length b must be
even, so a byte never straddles two rows): byte j of a tile row gives elements 2j (hi) and 2j + 1
(lo), multiplied by x's even and odd entries (K contiguous) or summed into even and odd outputs
(N contiguous). A byte's two levels come from one 8-byte gather in `nf4_gemv`'s 256-entry pair
table. Where rows are whole quant blocks (every real model's shape) a tile row's bytes go in
groups of up to 32 (within one quant block) that decode their scale once; elsewhere (rows of 72
values) each byte decodes its own. Each weight is code[nibble] * absmax in fp32 rounded to the
weight dtype, exactly `PackedExperts.select`'s value. Sums in fp32, output rounded once to the
weight dtype.

Tiles: a cost model, per (M, N, K, orientation, bits, SM count), no fitted constants:
- a program step holds _TILE_VALUES weights (32 a thread on _WARPS warps: four 16-byte loads in
  flight a thread in 16-bit, one in NF4);
- the tile runs as far as it can along the contiguous axis: with K contiguous (Qwen3-MoE) a step
  reads up to _TILE_VALUES / 2 consecutive weights of 2 or more rows (`gemv.py`'s 2 x 2048 shape);
- every SM gets at least _WAVES programs (M * cdiv(N, BLOCK_N) >= _WAVES * SMs), so one program's
  loads overlap another's sums and the last wave is at most half idle: BLOCK_N is halved until
  there are that many, but with N contiguous (gpt-oss) not below one 32-byte DRAM sector a tile row
  (16 weights in 16-bit, 64 in NF4: one quant block), so no sector is fetched for a part of it;
  BLOCK_K = _TILE_VALUES / BLOCK_N there.
No split-K: where N is narrow, N contiguous and M small (gpt-oss's down at batch 1: 45 NF4 tiles x
4 pairs) fewer programs than _WAVES * SMs run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kestrel.kernels import nf4
# Triton helpers by bare name: torch.compile rebuilds a kernel's helpers only so (test_compile_closure)
from kestrel.kernels.nf4 import block_scales
from kestrel.kernels._utils import cdiv, interpreted, next_pow2, sm_count
from kestrel.kernels.decode.nf4_gemv import PAIR, _codes, _rounded, code_pairs
from kestrel.kernels.dispatch import use_triton
from kestrel.kernels.moe.nf4_experts import PackedExperts

_WAVES = 2  # programs an SM holds at least
_SECTOR_BITS = 32 * 8  # a DRAM sector: the shortest contiguous run a tile row reads
_TILE_VALUES = 4096  # weights a program step holds
_WARPS = 4
_PAIR_LOOKUP = tl.constexpr(PAIR)  # a global a compiled kernel reads must be a constexpr
_INTERPRETED_VALUES = 1 << 14  # the interpreter runs programs one by one: one program a pair, one step where it fits


# --- kernel ------------------------------------------------------------------------------------


@triton.jit
def _nf4_pairs(P, CODE, ABSMAX, CODE2, ABSMAX2, OFFSET, PAIRS, first_byte, rows, row_ok, c0,
               HALF: tl.constexpr, GROUP: tl.constexpr, ALIGNED: tl.constexpr, ROW_BYTES: tl.constexpr,
               BS: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr, DTYPE: tl.constexpr,
               INTERPRETED: tl.constexpr):
    """hi, lo (R, HALF / GROUP, GROUP) fp32 holding DTYPE values: the dequantized elements of bytes
    c0 .. c0 + HALF - 1 of rows `rows` (R,) (a row: ROW_BYTES bytes from first_byte + row * ROW_BYTES),
    in groups of GROUP bytes; hi is a byte's first element (high nibble), lo its second. ALIGNED
    (rows of whole quant blocks): a group lies in one quant block, so its scale is decoded once;
    else once a byte. Masked bytes give finite values."""
    NG: tl.constexpr = HALF // GROUP
    starts = c0 + tl.arange(0, NG) * GROUP  # (NG,) each group's first byte in the row
    off = starts[:, None] + tl.arange(0, GROUP)[None, :]  # (NG, GROUP)
    base = first_byte + rows.to(tl.int64) * ROW_BYTES  # (R,)
    byte = base[:, None, None] + off[None, :, :]  # (R, NG, GROUP)
    ok = row_ok[:, None, None] & (off < ROW_BYTES)[None, :, :]
    packed = tl.load(P + byte, mask=ok, other=0)
    if ALIGNED:
        blk = (base[:, None] + starts[None, :]) // (BS // 2)  # (R, NG)
        group_ok = row_ok[:, None] & (starts < ROW_BYTES)[None, :]
        scale = block_scales(ABSMAX, CODE2, ABSMAX2, OFFSET, blk, group_ok, BS2, NESTED, not INTERPRETED)[:, :, None]
    else:
        scale = block_scales(ABSMAX, CODE2, ABSMAX2, OFFSET, byte // (BS // 2), ok, BS2, NESTED, not INTERPRETED)
    hi, lo = _codes(packed, CODE, PAIRS, _PAIR_LOOKUP)  # one 8-byte gather a byte (`nf4_gemv._codes`)
    hi = _rounded(hi * scale, DTYPE, INTERPRETED).to(tl.float32)
    lo = _rounded(lo * scale, DTYPE, INTERPRETED).to(tl.float32)
    return hi, lo


@triton.jit
def _along_k(x_row, W, CODE, ABSMAX, CODE2, ABSMAX2, OFFSET, PAIRS, first, n, n_ok, stride_n,
             K: tl.constexpr, NF4: tl.constexpr, BS: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr,
             GROUP: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """(BLOCK_N,) fp32 sum_k x[k] W[n, k] for an expert stored (N, K), K contiguous; `first`: its
    first element (16-bit) or byte (NF4)."""
    if NF4:
        HALF: tl.constexpr = BLOCK_K // 2
        NG: tl.constexpr = HALF // GROUP
        j = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # (NG, GROUP) bytes of the step
        acc = tl.zeros((BLOCK_N, NG, GROUP), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            hi, lo = _nf4_pairs(W, CODE, ABSMAX, CODE2, ABSMAX2, OFFSET, PAIRS, first, n, n_ok, k0 // 2, HALF, GROUP,
                                ALIGNED, K // 2, BS, BS2, NESTED, DTYPE, INTERPRETED)
            cols = k0 + 2 * j  # even columns: the high nibbles
            x_even = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            x_odd = tl.load(x_row + cols + 1, mask=cols < K, other=0.0).to(tl.float32)
            acc += hi * x_even[None, :, :] + lo * x_odd[None, :, :]
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
    else:
        w_rows = W + first + n.to(tl.int64)[:, None] * stride_n
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & (cols < K)[None, :], other=0.0)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
    return y


@triton.jit
def _down_k(x_row, W, CODE, ABSMAX, CODE2, ABSMAX2, OFFSET, PAIRS, first, n0, n, n_ok, stride_k,
            N: tl.constexpr, K: tl.constexpr, NF4: tl.constexpr, BS: tl.constexpr, BS2: tl.constexpr,
            NESTED: tl.constexpr, GROUP: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """(BLOCK_N,) fp32 sum_k x[k] W[k, n] for an expert stored (K, N), N contiguous; outputs
    n = n0 .. n0 + BLOCK_N - 1."""
    if NF4:
        HALF: tl.constexpr = BLOCK_N // 2
        NG: tl.constexpr = HALF // GROUP
        even = tl.zeros((BLOCK_K, NG, GROUP), tl.float32)  # byte j of the tile: outputs n0 + 2j (hi), n0 + 2j + 1 (lo)
        odd = tl.zeros((BLOCK_K, NG, GROUP), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            hi, lo = _nf4_pairs(W, CODE, ABSMAX, CODE2, ABSMAX2, OFFSET, PAIRS, first, k, k < K, n0 // 2, HALF, GROUP,
                                ALIGNED, N // 2, BS, BS2, NESTED, DTYPE, INTERPRETED)
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)[:, None, None]
            even += hi * x
            odd += lo * x
        y = tl.reshape(tl.join(tl.sum(even, axis=0), tl.sum(odd, axis=0)), (BLOCK_N,))  # interleaved back
    else:
        w_cols = W + first + n[None, :]
        acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_cols + k.to(tl.int64)[:, None] * stride_k, mask=(k < K)[:, None] & n_ok[None, :], other=0.0)
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[:, None]
        y = tl.sum(acc, axis=0)
    return y


@triton.jit
def _expert_gemv_kernel(
    X, IDS, Y,  # x (M, K) in the weight dtype; expert ids (M,); y (M, N)
    W, CODE, ABSMAX, CODE2, ABSMAX2, OFFSET, PAIRS,  # 16-bit: the weight (repeated); NF4: `nf4._plan`'s six, code pairs
    stride_x, stride_y,
    N: tl.constexpr, K: tl.constexpr,  # constexpr: the interpreter cannot loop to a run-time bound (numpy >= 2.4)
    STRIDE_E: tl.constexpr, STRIDE_ROW: tl.constexpr,  # elements between experts, between rows of b
    K_CONTIG: tl.constexpr, NF4: tl.constexpr, BS: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr,
    GROUP: tl.constexpr, ALIGNED: tl.constexpr,  # NF4: bytes a scale group, rows of whole quant blocks (`_nf4_pairs`)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):
    DTYPE: tl.constexpr = Y.dtype.element_ty
    pair = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    expert = tl.load(IDS + pair).to(tl.int64)
    first = expert * (STRIDE_E // 2) if NF4 else expert * STRIDE_E  # NF4: in bytes
    x_row = X + pair.to(tl.int64) * stride_x
    if K_CONTIG:
        y = _along_k(x_row, W, CODE, ABSMAX, CODE2, ABSMAX2, OFFSET, PAIRS, first, n, n_ok, STRIDE_ROW, K, NF4, BS, BS2,
                     NESTED, GROUP, ALIGNED, BLOCK_N, BLOCK_K, DTYPE, INTERPRETED)
    else:
        y = _down_k(x_row, W, CODE, ABSMAX, CODE2, ABSMAX2, OFFSET, PAIRS, first, n0, n, n_ok, STRIDE_ROW, N, K, NF4, BS,
                    BS2, NESTED, GROUP, ALIGNED, BLOCK_N, BLOCK_K, DTYPE, INTERPRETED)
    tl.store(Y + pair.to(tl.int64) * stride_y + n, _rounded(y, DTYPE, INTERPRETED), mask=n_ok)


# --- the weights --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert as this kernel reads it (built once by `expert_weights`).

    source: what the PyTorch reference gathers from (the (E, a, b) tensor or the `PackedExperts`)
    transposed: stored (E, in, out) (gpt-oss), else (E, out, in) (Qwen3-MoE)
    tensors: the kernel's seven weight operands (16-bit: the weight seven times; NF4: packed, code,
        absmax, code2, absmax2, offset as `nf4._plan` gives them, and `nf4_gemv.code_pairs(code)`)
    stride_e, stride_row: elements between experts and between rows of the contiguous axis b
    reason: why the kernel cannot read them ("" when it can)
    """

    source: torch.Tensor | PackedExperts
    transposed: bool
    tensors: tuple[torch.Tensor, ...]
    shape: tuple[int, int, int]  # (E, a, b) as stored
    dtype: torch.dtype
    stride_e: int
    stride_row: int
    nf4: bool
    nested: bool = False
    blocksize: int = 1
    blocksize2: int = 1
    sms: int = 1
    reason: str = ""

    @property
    def k(self) -> int:
        return self.shape[1] if self.transposed else self.shape[2]

    @property
    def n(self) -> int:
        return self.shape[2] if self.transposed else self.shape[1]

    @property
    def bits(self) -> int:
        """Bits a stored weight takes (NF4: the codes only)."""
        return 4 if self.nf4 else self.dtype.itemsize * 8


def expert_weights(source: torch.Tensor | PackedExperts, transposed: bool) -> ExpertWeights:
    """The kernel's view of `source` ((E, a, b) weight or NF4 experts in the stored layout); no copies of
    the weights (NF4: a 2 KB table of code pairs)."""
    if isinstance(source, PackedExperts):
        plan = nf4._plan(source.packed, source.state)
        e, a, b = source.stored_shape
        reason = "" if b % 2 == 0 and plan.tensors[0].is_contiguous() else f"NF4 rows of {b} values split bytes"
        tensors = (*plan.tensors, code_pairs(plan.tensors[1]))
        return ExpertWeights(source, transposed, tensors, (e, a, b), source.dtype, a * b, b, True, plan.nested,
                             plan.blocksize, plan.blocksize2, sm_count(source.packed.device), reason)
    shape = tuple(source.shape)
    reason = ""
    if source.dim() != 3 or source.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        reason = f"expert weights of shape {shape} in {source.dtype}: need (E, a, b) in bf16, fp16 or fp32"
    elif source.shape[2] > 1 and source.stride(2) != 1:
        reason = "expert weights not contiguous along their last dimension"
    strides = source.stride() if source.dim() == 3 else (0, 0, 0)
    return ExpertWeights(source, transposed, (source,) * 7, shape if source.dim() == 3 else (0, 0, 0), source.dtype,
                         strides[0], strides[1], False, sms=sm_count(source.device), reason=reason)


class ExpertTiles(NamedTuple):
    block_n: int
    block_k: int


def expert_tiles(m: int, n: int, k: int, k_contig: bool, bits: int, sms: int) -> ExpertTiles:
    """The cost model's tiles (module docstring) for m pairs of an (N, K) product, `bits` a weight."""
    if k_contig:  # the contiguous axis is summed over: all of the step's run along it, rows of N for programs
        block_k = min(next_pow2(k), _TILE_VALUES // 2)
        block_n, floor_n = min(_TILE_VALUES // block_k, next_pow2(n)), 2
    else:  # the contiguous axis is the output's: programs come from cutting it, down to one sector a row
        block_n, floor_n = min(next_pow2(n), _TILE_VALUES // 2), min(_SECTOR_BITS // bits, next_pow2(n))
    while block_n > floor_n and m * cdiv(n, block_n) < _WAVES * sms:
        block_n //= 2
    if not k_contig:
        block_k = min(_TILE_VALUES // block_n, next_pow2(k))
    return ExpertTiles(max(block_n, 2), max(block_k, 2))  # NF4 reads pairs along the contiguous axis


# --- host ------------------------------------------------------------------------------------------


def applies(x: torch.Tensor, weights: ExpertWeights) -> bool:
    """True when the kernel takes these products: weights it reads (`reason` empty) and the Triton
    kernels chosen (`kestrel.kernels.dispatch`: CUDA tensors, or forced)."""
    return not weights.reason and use_triton(x, weights.tensors[0])


def expert_gemv(x: torch.Tensor, ids: torch.Tensor, weights: ExpertWeights,
                tiles: ExpertTiles | None = None) -> torch.Tensor:
    """x (M, K) pair rows (cast to the weight dtype), ids (M,) their experts on the device ->
    (M, N) in the weight dtype. No checks (`applies`). `tiles`: override the cost model's (tests)."""
    m = x.shape[0]
    x, ids = x.to(weights.dtype), ids.contiguous()  # no copies where they are already so
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((m, weights.n), dtype=weights.dtype, device=x.device)
    if m == 0:
        return y
    k_contig = not weights.transposed
    if tiles is not None:
        t = tiles
    elif interpreted():
        block_n = min(next_pow2(weights.n), _INTERPRETED_VALUES // 2)
        t = ExpertTiles(max(block_n, 2), max(min(next_pow2(weights.k), _INTERPRETED_VALUES // block_n), 2))
    else:
        t = expert_tiles(m, weights.n, weights.k, k_contig, weights.bits, weights.sms)
    half_bytes = (t.block_k if k_contig else t.block_n) // 2  # NF4 bytes a tile row reads a step
    row_bytes = weights.shape[2] // 2
    # kernel[grid] (not `_launch.launch`): the decode step is traced by torch.compile, which launches it itself
    _expert_gemv_kernel[(m, cdiv(weights.n, t.block_n))](
        x, ids, y, *weights.tensors, x.stride(0), y.stride(0), N=weights.n, K=weights.k, STRIDE_E=weights.stride_e,
        STRIDE_ROW=weights.stride_row, K_CONTIG=k_contig, NF4=weights.nf4, BS=weights.blocksize, BS2=weights.blocksize2,
        NESTED=weights.nested, GROUP=max(1, min(half_bytes, weights.blocksize // 2)),
        ALIGNED=weights.nf4 and row_bytes % (weights.blocksize // 2) == 0, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        INTERPRETED=interpreted(), num_warps=_WARPS,
    )
    return y


def gathered_products(x: torch.Tensor, ids: torch.Tensor, source: torch.Tensor | PackedExperts,
                      transposed: bool) -> torch.Tensor:
    """The PyTorch reference of `expert_gemv`: the chosen experts' slices gathered into an
    (M, a, b) copy (NF4: dequantized from the chosen experts' codes, `PackedExperts.select`, or
    from the whole tensor where experts are not whole quant blocks), one batched matmul."""
    if isinstance(source, PackedExperts):
        w = source.select(ids) if source.selectable else source.stored()[ids]
    else:
        w = source[ids]
    return torch.bmm(x[:, None].to(w.dtype), w if transposed else w.transpose(1, 2))[:, 0]


def expert_products(x: torch.Tensor, ids: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
    """x (M, K), ids (M,) -> (M, N): the kernel where it `applies`, else the gathered reference."""
    if applies(x, weights):
        return expert_gemv(x, ids, weights)
    return gathered_products(x, ids, weights.source, weights.transposed)
