"""Small-batch products over NF4 weights read packed: y = x dequant(W)^T for 1..16 rows.

A decode step over a QLoRA base (chat, GRPO rollouts) multiplies 1-16 rows by every NF4 matrix
once; its time is the bytes of the weights over memory bandwidth. bitsandbytes runs a 4-bit
matrix-vector kernel at one row and dequantize + GEMM above it (the 16-bit weight written and
read back: 4.5x the packed bytes), one launch per projection. This kernel reads the packed
nibbles and the block scales and never writes a dequantized weight: the values are formed in
registers, tile by tile, and every row of x is multiplied by each tile while it is there.

Format (`kernels/nf4.py`): an (out, K) matrix is `out * K / 2` bytes, row-major, element 2j in
the HIGH nibble of byte j; one absmax per `blocksize` (64) consecutive elements. K must be a
multiple of the blocksize, so each row is whole quant blocks: row r's bytes start at r K / 2
and its scales at r K / blocksize, and a member's rows can be addressed on their own.

Value: W[i] = dtype(code[nibble] * absmax[block]) computed in fp32 and rounded once to x's
dtype, exactly what the 16-bit dequantized weight holds (`nf4.dequantize_reference`), so the
product is the dequantized 16-bit product up to the order of its fp32 sums.

`NF4Weight` groups up to three members with the same K along the output dimension (q/k/v,
gate/up): one launch reads x once for the group. No packed byte is copied: the kernel takes one
pointer per member and each output row picks its member's (several pointers, not a concatenated
buffer, which would either double the 4-bit weights in memory or move them under bitsandbytes).
The absmax is decoded to fp32 ONCE, when the group is built, from double quantization
(`code2[q] * absmax2[b // 256] + offset`, with each member's own offset): trade-off, 4 bytes per
64 weights are read instead of 1 (36 bytes a block instead of 33, +9% of the linears' bytes) and
kept in memory beside the packed weights (+12.5% of them: ~0.44 GB at 8B), against a kernel that
needs neither the nested decode per tile (a second table lookup and a mul + add that must not be
fused into an FMA to round as bitsandbytes does) nor per-member offsets.

Two ways through a tile (BLOCK_N rows x BLOCK_K columns; byte j of a block gives elements 2j,
2j + 1, which multiply x's even and odd columns: no interleaving of the decoded values):
- one row of x (BLOCK_M = 1): fp32 multiply-adds into a (BLOCK_N, BLOCK_K / 2) accumulator,
  reduced once at the end (as `kernels/gemv.py`);
- 2..16 rows (BLOCK_M = 16): the decoded tile in x's dtype times x^T on tensor cores (`tl.dot`,
  fp32 accumulation; the products of two 16-bit values are exact in fp32).

Split-K: when N has too few row tiles to keep enough bytes in flight, SPLIT programs share a row
tile, each summing K / SPLIT columns; each writes its fp32 partial, and the last to finish
(a ticket counter per tile) adds the SPLIT partials in split order (deterministic), rounds,
writes y and resets the counter. One launch, no second reduction kernel.

Tiles (`choose_tiles`): BLOCK_N and SPLIT from a cost model (`tile_cost`), per shape and M;
BLOCK_K and warps per path, the ones whose code was fastest at every 8B shape and M in a sweep
of 376 compiled (tiles, M) variants (`python bench/nf4_gemv_tiles.py`, H100): one row 512
columns on 2 warps (2048 columns: 1.4-1.6x slower), tensor cores 128 columns on 4 warps (256:
1.5-1.7x slower); software pipelining (num_stages 3) was 5-7x slower. The model, in HBM bytes:
- bytes in flight: a program has one (BLOCK_N, BLOCK_K / 2)-byte tile of packed weight in
  flight at a time, and an SM holds _RESIDENT_* programs at once, so by Little's law a launch
  streams at about min(bandwidth, resident programs x tile bytes / latency); the weight's bytes
  are divided by that fraction of the bandwidth, reached at _INFLIGHT_PER_SM bytes per SM
  (bandwidth x latency over the SMs: 3.35 TB/s x ~1.2 us / 132 ~ 32 KiB on an H100);
- x re-reads: every program loads its K range of all M rows of x (M x 2 bytes a column, from
  L1/L2, then split into even/odd columns) against BLOCK_N x 9/16 bytes of weight: weighted
  _X_COST a byte, this favours tall row tiles;
- balance: the busiest SM runs ceil(programs / SMs) programs, the bandwidth is divided by
  programs / (SMs x that);
- split-K partials: 8 SPLIT M bytes a row (written, read back by the last split in series),
  _PARTIAL_COST a byte;
- registers: the decoded tile is BLOCK_N x BLOCK_K values over 32 x warps threads, at most
  _VALUES_PER_THREAD a thread (more spilled or starved occupancy in the sweep).
Checked against the sweep: at 8 rows the model's (BLOCK_N, SPLIT) are the fastest measured or
within 2% of it at q/k/v, o, gate/up and down; at one row within 6% (4 rows against 8 at o, down).

Measured there (H100, us per launch, weights rotated past L2; bitsandbytes: one call a member):
                 one row: this / bnb GEMV / bf16 GEMV     8 rows: this / bnb dequant + GEMM
    q/k/v 6144      19.7 / 26.4 / 21.2                          26.4 / 68.9
    o     4096      15.2 / 11.9 /  9.6                          18.4 / 36.2
    gate/up 28672   78.2 / 57.4 / 78.0                         102.1 / 131.0
    down  4096^T    46.2 / 29.7 / 45.0                          54.2 / 122.8
The kernel is bound by forming the values (a table lookup, a multiply and a rounding per weight:
~1.2-1.5e12 weights/s whatever M, 0.8-1.1 TB/s of packed weight), not by memory; bitsandbytes'
one-row GEMV forms them faster (in bf16 arithmetic, not bit-exact with its own dequantize), so
the decode path (`applies`) uses this kernel from MIN_ROWS = 2 rows and keeps bitsandbytes' at one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import nf4
from kernels._utils import cdiv, interpreted, next_pow2, sm_count
from kernels.dispatch import use_triton

MAX_ROWS = 16  # rows of x one launch takes (the tensor-core tile's M)
MIN_ROWS = 2  # rows from which the decode path prefers this kernel (the module docstring's table)
MAX_MEMBERS = 3
_SPLIT_MIN_ROWS = 16  # split-K tiles have at least this many rows: one ticket per 16 rows suffices
# Per path (one row; tensor cores): BLOCK_K, warps, programs an SM holds at once (the sweep).
_FMA_K, _FMA_WARPS, _RESIDENT_FMA = 512, 2, 16
_DOT_K, _DOT_WARPS, _RESIDENT_DOT = 128, 4, 4
_VALUES_PER_THREAD = 64  # decoded weight values per thread per step (registers)
_INFLIGHT_PER_SM = 32 * 1024  # bytes in flight per SM that cover memory latency (Little's law)
_X_COST = 0.4  # a byte of x from cache, against a byte of weight from HBM
_PARTIAL_COST = 2.0  # a byte of split-K partials: written, then read back in series by the last split


# --- kernel ------------------------------------------------------------------------------------


@triton.jit
def _member_ptrs(rows, end0, end1, P0, P1, P2, PER_ROW: tl.constexpr, MEMBERS: tl.constexpr):
    """(BLOCK_N,) pointers to the first of PER_ROW elements of each row in its member's array:
    rows [0, end0) are member 0's, [end0, end1) member 1's, the rest member 2's."""
    r = rows.to(tl.int64)
    if MEMBERS == 1:
        ptrs = P0 + r * PER_ROW
    elif MEMBERS == 2:
        ptrs = tl.where(r >= end0, P1 + (r - end0) * PER_ROW, P0 + r * PER_ROW)
    else:
        first_two = tl.where(r >= end0, P1 + (r - end0) * PER_ROW, P0 + r * PER_ROW)
        ptrs = tl.where(r >= end1, P2 + (r - end1) * PER_ROW, first_two)
    return ptrs


@triton.jit
def _rounded(v, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 v rounded to nearest-even DTYPE, as torch's cast. Compiled: a DTYPE tensor.
    Interpreted: fp32 holding the DTYPE value, bf16 rounded by hand (the interpreter truncates
    fp32 -> bf16, and its tl.dot reads bf16 operands as raw integers)."""
    if INTERPRETED:
        if DTYPE == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
            out = bits.to(tl.float32, bitcast=True)
        else:
            out = v.to(DTYPE).to(tl.float32)
    else:
        out = v.to(DTYPE)
    return out


@triton.jit
def _weight_pairs(w_rows, s_rows, CODE, blk0, N_BLK: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr,
                  EVEN: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Quant blocks blk0 .. blk0 + NB - 1 of each row, dequantized: (hi, lo), each (BLOCK_N, NB,
    HB), hi[.., b, j] = element 2j of block b (byte j's high nibble), lo = element 2j + 1.
    Blocks at or past N_BLK read as zeros (unless EVEN: none are)."""
    blk = blk0 + tl.arange(0, NB)  # (NB,)
    byte = blk[:, None] * HB + tl.arange(0, HB)[None, :]  # (NB, HB) byte offsets within a row
    if EVEN:
        packed = tl.load(w_rows[:, None, None] + byte[None, :, :])
        scale = tl.load(s_rows[:, None] + blk[None, :])
    else:
        ok = (blk < N_BLK)[None, :]
        packed = tl.load(w_rows[:, None, None] + byte[None, :, :], mask=ok[:, :, None], other=0)
        scale = tl.load(s_rows[:, None] + blk[None, :], mask=ok, other=0.0)
    scale = scale[:, :, None]
    hi = _rounded(tl.load(CODE + (packed >> 4).to(tl.int32)) * scale, DTYPE, INTERPRETED)
    lo = _rounded(tl.load(CODE + (packed & 15).to(tl.int32)) * scale, DTYPE, INTERPRETED)
    return hi, lo


@triton.jit
def _fma_rows(X, w_rows, s_rows, CODE, blk_first, BLOCK_N: tl.constexpr, N_BLK: tl.constexpr,
              NB: tl.constexpr, HB: tl.constexpr, STEPS: tl.constexpr, EVEN: tl.constexpr,
              DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """(BLOCK_N, 1) fp32: one row of x times BLOCK_N weight rows over STEPS tiles of NB blocks."""
    pair = tl.arange(0, HB)[:, None] * 2 + tl.arange(0, 2)[None, :]  # (HB, 2): columns 2j, 2j + 1
    acc = tl.zeros((BLOCK_N, NB, HB), tl.float32)
    for i in range(STEPS):
        blk0 = blk_first + i * NB
        hi, lo = _weight_pairs(w_rows, s_rows, CODE, blk0, N_BLK, NB, HB, EVEN, DTYPE, INTERPRETED)
        blk = blk0 + tl.arange(0, NB)
        cols = blk[:, None, None] * (2 * HB) + pair[None, :, :]  # (NB, HB, 2)
        if EVEN:
            x = tl.load(X + cols)
        else:
            x = tl.load(X + cols, mask=(blk < N_BLK)[:, None, None], other=0.0)
        x_even, x_odd = tl.split(x.to(tl.float32))  # (NB, HB) each
        acc += hi.to(tl.float32) * x_even[None, :, :] + lo.to(tl.float32) * x_odd[None, :, :]
    return tl.sum(tl.sum(acc, axis=2), axis=1)[:, None]


@triton.jit
def _dot_rows(X, M, stride_x, w_rows, s_rows, CODE, blk_first, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              N_BLK: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr, STEPS: tl.constexpr,
              EVEN: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """(BLOCK_N, BLOCK_M) fp32: the weight rows times up to BLOCK_M rows of x, on tensor cores."""
    BLOCK_K: tl.constexpr = NB * 2 * HB
    m = tl.arange(0, BLOCK_M)
    x_rows = X + m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for i in range(STEPS):
        blk0 = blk_first + i * NB
        hi, lo = _weight_pairs(w_rows, s_rows, CODE, blk0, N_BLK, NB, HB, EVEN, DTYPE, INTERPRETED)
        cols = blk0 * (2 * HB) + tl.arange(0, BLOCK_K)
        ok = (m < M)[:, None] & (cols < N_BLK * 2 * HB)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=ok, other=0.0)  # (BLOCK_M, BLOCK_K)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
        hi = tl.reshape(hi, (BLOCK_N, BLOCK_K // 2))
        lo = tl.reshape(lo, (BLOCK_N, BLOCK_K // 2))
        if INTERPRETED:  # fp32 operands holding 16-bit values: exact products, as on the GPU
            acc = tl.dot(hi, tl.trans(x_even.to(tl.float32)), acc, input_precision="ieee")
            acc = tl.dot(lo, tl.trans(x_odd.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(hi, tl.trans(x_even), acc)
            acc = tl.dot(lo, tl.trans(x_odd), acc)
    return acc


@triton.jit
def _store(y, Y, bias, rows, row_ok, M, stride_y, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y (BLOCK_N, BLOCK_M) fp32 (+ bias), rounded to Y's dtype, into Y[m, rows]."""
    if HAS_BIAS:
        y += bias[:, None]
    m = tl.arange(0, BLOCK_M)
    out = Y + m.to(tl.int64)[None, :] * stride_y + rows[:, None]
    tl.store(out, y.to(Y.dtype.element_ty), mask=row_ok[:, None] & (m < M)[None, :])


@triton.jit
def _nf4_gemv_kernel(
    X, Y, PART, TICKETS,  # x (M, K); y (M, N); split-K fp32 partials; int32 tickets, zero between launches
    W0, W1, W2, S0, S1, S2, B0, B1, B2,  # per member: packed uint8, fp32 absmax, bias (unused ones repeat W0...)
    CODE,  # fp32 (16,) NF4 levels
    M, N, end0, end1, stride_x, stride_y,
    K: tl.constexpr, BS: tl.constexpr, MEMBERS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_K // BS  # quant blocks a step
    HB: tl.constexpr = BS // 2  # bytes a quant block
    N_BLK: tl.constexpr = K // BS  # quant blocks a row
    STEPS: tl.constexpr = (N_BLK + NB * SPLIT - 1) // (NB * SPLIT)  # steps a split
    EVEN: tl.constexpr = N_BLK % (NB * SPLIT) == 0
    DTYPE: tl.constexpr = X.dtype.element_ty
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    safe = tl.minimum(rows, N - 1)  # rows past N re-read row N - 1, never stored: loads need no mask
    w_rows = _member_ptrs(safe, end0, end1, W0, W1, W2, K // 2, MEMBERS)
    s_rows = _member_ptrs(safe, end0, end1, S0, S1, S2, N_BLK, MEMBERS)
    if HAS_BIAS:
        bias = tl.load(_member_ptrs(safe, end0, end1, B0, B1, B2, 1, MEMBERS)).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_N,), tl.float32)
    blk_first = split * STEPS * NB
    if BLOCK_M == 1:
        y = _fma_rows(X, w_rows, s_rows, CODE, blk_first, BLOCK_N, N_BLK, NB, HB, STEPS, EVEN, DTYPE, INTERPRETED)
    else:
        y = _dot_rows(X, M, stride_x, w_rows, s_rows, CODE, blk_first, BLOCK_M, BLOCK_N, N_BLK, NB, HB, STEPS,
                      EVEN, DTYPE, INTERPRETED)
    if SPLIT == 1:
        _store(y, Y, bias, rows, row_ok, M, stride_y, BLOCK_M, HAS_BIAS)
    else:
        _split_k_finish(y, Y, PART, TICKETS, bias, rows, row_ok, M, stride_y, pid_n, split, BLOCK_M, BLOCK_N,
                        SPLIT, HAS_BIAS)


@triton.jit
def _split_k_finish(y, Y, PART, TICKETS, bias, rows, row_ok, M, stride_y, pid_n, split, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Write this split's partial; the last split of the row tile to arrive (its ticket) sums
    all SPLIT partials in split order, stores y and resets the ticket for the next launch."""
    TILE: tl.constexpr = BLOCK_N * BLOCK_M
    idx = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    part = PART + pid_n.to(tl.int64) * (SPLIT * TILE)
    used = (tl.arange(0, BLOCK_M) < M)[None, :] & (idx >= 0)  # rows of x past M: never read back
    tl.store(part + split * TILE + idx, y, mask=used)
    tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
    ticket = tl.atomic_add(TICKETS + pid_n, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLIT - 1:
        total = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for s in range(SPLIT):  # .cg: from L2, where the other programs' partials are
            total += tl.load(part + s * TILE + idx, mask=used, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(TICKETS + pid_n, 0, sem="relaxed", scope="gpu")
        _store(total, Y, bias, rows, row_ok, M, stride_y, BLOCK_M, HAS_BIAS)


# --- the weight ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NF4Weight:
    """Up to three NF4 matrices of the same K stacked along the output dimension, as the kernel
    reads them (member i owns output rows [ends[i - 1], ends[i])). Built by `nf4_weight`.

    packed: per member, uint8 (out_i * K / 2,): the Params4bit's own storage (an alias, no copy)
    absmax: per member, fp32 (out_i * K / blocksize,): decoded once (the module docstring)
    bias: per member, (out_i,) in the compute dtype (zeros for a member without one), or None
    code: fp32 (16,) the NF4 levels
    tickets: int32 (cdiv(N, 16),) zeros: split-K counters, left zero by every launch
    """

    packed: tuple[torch.Tensor, ...]
    absmax: tuple[torch.Tensor, ...]
    bias: tuple[torch.Tensor, ...] | None
    code: torch.Tensor
    tickets: torch.Tensor
    sizes: tuple[int, ...]
    k: int
    blocksize: int
    dtype: torch.dtype  # the compute dtype the values are rounded to (x's)
    sms: int

    @property
    def n(self) -> int:
        return sum(self.sizes)

    @property
    def nbytes(self) -> int:
        """Bytes a product reads from the weight: packed nibbles, fp32 absmax, bias."""
        tensors = [*self.packed, *self.absmax, *(self.bias or ())]
        return sum(t.numel() * t.element_size() for t in tensors)


def unsupported(packed: torch.Tensor, quant_state: Any, k: int | None = None) -> str:
    """Why an NF4 weight cannot be read by this kernel ("" when it can)."""
    if getattr(quant_state, "quant_type", None) != "nf4" or packed.dtype != torch.uint8:
        return "not an NF4 weight"
    if getattr(quant_state, "packing_format_for_cpu", False):
        return "repacked for bitsandbytes' CPU kernel"
    shape = tuple(int(d) for d in quant_state.shape)
    bs = int(quant_state.blocksize)
    if len(shape) != 2 or packed.numel() * 2 != shape[0] * shape[1]:
        return f"packed bytes do not match shape {shape}"
    if bs < 16 or bs & (bs - 1) or shape[1] % bs:
        return f"in_features {shape[1]} is not a multiple of the power-of-two blocksize {bs}"
    if k is not None and shape[1] != k:
        return "members differ in in_features"
    if not packed.is_contiguous():
        return "packed weight is not contiguous"
    return ""


def nf4_weight(members: Sequence[tuple[torch.Tensor, Any, torch.Tensor | None]],
               dtype: torch.dtype) -> NF4Weight:
    """members: (packed uint8, quant_state, bias or None) each, same K and blocksize, at most
    three -> the `NF4Weight` of them stacked, values rounded to `dtype` (fp16 or bf16).
    Raises ValueError when they cannot be read together (`unsupported`)."""
    if not 1 <= len(members) <= MAX_MEMBERS or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{len(members)} members in {dtype}: need 1-{MAX_MEMBERS} in fp16 or bf16")
    k = int(members[0][1].shape[1])
    bs = int(members[0][1].blocksize)
    device = members[0][0].device
    code = nf4._code(members[0][1], device)
    for packed, state, _ in members:
        reason = unsupported(packed, state, k)
        if not reason and int(state.blocksize) != bs:
            reason = "members differ in blocksize"
        if not reason and not torch.equal(nf4._code(state, device), code):
            reason = "members differ in their NF4 code"
        if reason:
            raise ValueError(reason)
    sizes = tuple(int(state.shape[0]) for _, state, _ in members)
    has_bias = any(b is not None for _, _, b in members)
    bias = tuple(torch.zeros(n, dtype=dtype, device=device) if b is None else b.detach()
                 for n, (_, _, b) in zip(sizes, members)) if has_bias else None
    return NF4Weight(
        packed=tuple(torch.Tensor.as_subclass(p, torch.Tensor).reshape(-1) for p, _, _ in members),
        absmax=tuple(decoded_absmax(s, device) for _, s, _ in members), bias=bias, code=code,
        tickets=torch.zeros(cdiv(sum(sizes), _SPLIT_MIN_ROWS), dtype=torch.int32, device=device),
        sizes=sizes, k=k, blocksize=bs, dtype=dtype, sms=sm_count(device),
    )


def decoded_absmax(quant_state: Any, device: torch.device) -> torch.Tensor:
    """fp32 (n_blocks,) absmax of a weight, decoded from double quantization exactly as
    bitsandbytes does (`nf4._absmax_reference`: mul and add rounded separately); a plain fp32
    absmax is returned as is (no copy)."""
    n = 1
    for d in quant_state.shape:
        n *= int(d)
    n_blocks = cdiv(n, int(quant_state.blocksize))
    return nf4._absmax_reference(quant_state, n_blocks, device).contiguous()


# --- tiles -----------------------------------------------------------------------------------------


class Tiles(NamedTuple):
    block_m: int  # 1: fp32 multiply-adds; 16: tensor cores
    block_n: int
    block_k: int
    split: int
    warps: int = 4
    stages: int = 1


def choose_tiles(m: int, n: int, k: int, blocksize: int, sms: int) -> Tiles:
    """The tiles of least `tile_cost` for m rows of x times an (n, k) weight on `sms` SMs
    (no cache: plain integer work, traced as is inside torch.compile)."""
    if m == 1:
        block_m, warps, rows, splits = 1, _FMA_WARPS, (1, 2, 4, 8, 16), (1,)
        block_k = _FMA_K
    else:
        block_m, warps, rows, splits = MAX_ROWS, _DOT_WARPS, (16, 32, 64, 128), (1, 2, 4, 8, 16)
        block_k = _DOT_K
    block_k = max(blocksize, min(block_k, next_pow2(k)))
    best: tuple[float, int, Tiles] | None = None
    for block_n in rows:
        if block_n * block_k > _VALUES_PER_THREAD * 32 * warps and block_n > rows[0]:
            break
        for split in splits:
            if split > 1 and cdiv(k, block_k) < 2 * split:
                break
            t = Tiles(block_m, block_n, block_k, split, warps)
            key = (tile_cost(t, m, n, k, sms), cdiv(n, block_n) * split, t)
            best = key if best is None or key[:2] < best[:2] else best
    assert best is not None
    return best[2]


def tile_cost(t: Tiles, m: int, n: int, k: int, sms: int) -> float:
    """Relative time of a launch with tiles `t` (the module docstring's model), in bytes of HBM:
    the weight's bytes over the fraction of bandwidth its in-flight bytes and its balance over the
    SMs sustain, plus x re-reads (_X_COST a byte) and split-K partials (_PARTIAL_COST a byte)."""
    programs = cdiv(n, t.block_n) * t.split
    resident = min(programs, sms * (_RESIDENT_FMA if t.block_m == 1 else _RESIDENT_DOT))
    inflight = resident * t.block_n * t.block_k // 2
    balance = programs / (sms * cdiv(programs, sms))  # the busiest SM has ceil(programs / sms)
    weight = n * k * 9 // 16  # packed nibbles + fp32 absmax
    x_reads = programs * cdiv(k, t.split) * m * 2
    partials = 8 * t.split * m * n if t.split > 1 else 0  # fp32, written and read back
    streamed = weight / (min(1.0, inflight / (_INFLIGHT_PER_SM * sms)) * balance)
    return streamed + x_reads * _X_COST + partials * _PARTIAL_COST


# --- host ------------------------------------------------------------------------------------------


def applies(x: torch.Tensor, weight: NF4Weight) -> bool:
    """True when the decode path should run this product here: MIN_ROWS to MAX_ROWS rows of x in
    the weight's compute dtype, and the Triton kernels chosen (`kernels.dispatch`: CUDA tensors,
    or forced). (`nf4_gemv` itself takes one row too.)"""
    return (x.shape[-1] == weight.k and MIN_ROWS <= rows_of(x) <= MAX_ROWS and x.dtype == weight.dtype
            and use_triton(x, weight.packed[0]))


def rows_of(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[-1])


def nf4_gemv(x: torch.Tensor, weight: NF4Weight, tiles: Tiles | None = None) -> torch.Tensor:
    """x (..., K) with at most MAX_ROWS rows, in `weight.dtype` -> (..., N) in x's dtype:
    x dequant(W)^T (+ bias), fp32 sums, rounded once. `tiles`: override `choose_tiles` (tests).
    The PyTorch reference where the Triton kernels are not chosen."""
    k, n = weight.k, weight.n
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if not 0 < m <= MAX_ROWS or x.dtype != weight.dtype:
        raise ValueError(f"nf4_gemv takes 1-{MAX_ROWS} rows of {weight.dtype}, got {m} of {x.dtype}")
    if not use_triton(x, weight.packed[0]):
        return nf4_gemv_reference(x, weight)
    t = tiles or choose_tiles(m, n, k, weight.blocksize, weight.sms)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid_n = cdiv(n, t.block_n)
    if t.split > 1 and (t.block_n < _SPLIT_MIN_ROWS or grid_n > weight.tickets.numel()):
        raise ValueError(f"split-K needs row tiles of at least {_SPLIT_MIN_ROWS} rows, got {t}")
    part = torch.empty(grid_n * t.split * t.block_n * t.block_m if t.split > 1 else 1, dtype=torch.float32,
                       device=x.device)
    members = len(weight.sizes)
    w, s = _padded(weight.packed), _padded(weight.absmax)
    b = _padded(weight.bias) if weight.bias is not None else w
    ends = [sum(weight.sizes[: i + 1]) for i in range(MAX_MEMBERS - 1)]
    _nf4_gemv_kernel[(grid_n, t.split)](
        rows, y, part, weight.tickets, *w, *s, *b, weight.code, m, n, ends[0], ends[1], rows.stride(0), y.stride(0),
        K=k, BS=weight.blocksize, MEMBERS=members, HAS_BIAS=weight.bias is not None, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT=t.split, INTERPRETED=interpreted(), num_warps=t.warps,
        num_stages=t.stages,
    )
    return y.view(*x.shape[:-1], n)


def _padded(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Exactly MAX_MEMBERS tensors: the unused pointer slots repeat the first (never read)."""
    return tensors + (tensors[0],) * (MAX_MEMBERS - len(tensors))


def dequantized(weight: NF4Weight) -> torch.Tensor:
    """(N, K) in `weight.dtype`: the stacked members dequantized (PyTorch; tests, the reference)."""
    parts = []
    for packed, absmax, n in zip(weight.packed, weight.absmax, weight.sizes):
        nibbles = torch.stack((packed >> 4, packed & 15), dim=-1).reshape(n, weight.k).long()
        scale = absmax.view(n, weight.k // weight.blocksize).repeat_interleave(weight.blocksize, dim=1)
        parts.append((weight.code[nibbles] * scale).to(weight.dtype))
    return torch.cat(parts)


def nf4_gemv_reference(x: torch.Tensor, weight: NF4Weight) -> torch.Tensor:
    """x (..., K) -> (..., N): the dequantized 16-bit weight times x in fp32, rounded to x's dtype."""
    bias = None if weight.bias is None else torch.cat(weight.bias).float()
    return F.linear(x.float(), dequantized(weight).float(), bias).to(x.dtype)
