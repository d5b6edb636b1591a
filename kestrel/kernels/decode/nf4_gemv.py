"""Small-batch products over NF4 weights read packed: y = x dequant(W)^T for 1..16 rows.

A decode step over a QLoRA base (chat, GRPO rollouts) multiplies 1-16 rows by every NF4 matrix
once; its time is the bytes of the weights over memory bandwidth. bitsandbytes runs a 4-bit
matrix-vector kernel at one row and dequantize + GEMM above it (the 16-bit weight written and
read back: 4.5x the packed bytes), one launch per projection. This kernel reads the packed
nibbles and the block scales and never writes a dequantized weight: the values are formed in
registers, tile by tile, and every row of x is multiplied by each tile while it is there.

Format (`kestrel/kernels/nf4.py`): an (out, K) matrix is `out * K / 2` bytes, row-major, element
2j in the HIGH nibble of byte j; one absmax per `blocksize` (64) consecutive elements. K must be
a multiple of the blocksize, so row r's bytes start at r K / 2 and its scales at r K / blocksize.
Values are computed in fp32 and rounded once to x's dtype, exactly what the 16-bit dequantized
weight holds (`nf4.dequantize_reference`): the product is the dequantized 16-bit product up to
the order of its fp32 sums.

`NF4Weight` groups up to three members with the same K along the output dimension (q/k/v,
gate/up): one launch reads x once for the group, through one pointer per member (a concatenated
buffer would either double the 4-bit weights in memory or move them under bitsandbytes). The
double-quantized absmax is decoded to fp32 once, when the group is built: 36 bytes read per 64
weights instead of 33, and ~0.44 GB kept beside the 8B shape's packed weights, for a kernel with
no nested decode per tile (whose mul + add must not fuse into an FMA) and no per-member offsets.

Two ways through a tile (BLOCK_N rows x BLOCK_K columns; byte j gives elements 2j, 2j + 1, which
multiply x's even and odd columns): one row of x as fp32 multiply-adds into a (BLOCK_N,
BLOCK_K / 2) accumulator reduced once at the end (as `kestrel/kernels/decode/gemv.py`); 2..16
rows (or one, where measured faster) as the decoded tile times x^T on tensor cores (`tl.dot`,
fp32 accumulation). Split-K (at any row count: few, long rows need it to fill the SMs) is
finished in the same launch: the last of a tile's SPLIT programs (a ticket counter) adds the fp32
partials in split order (deterministic) and resets the counter.

The work per weight, not the bytes, sets the pace (bench/RESULTS.md, Decode "Session 15" and
"Session 18": 0.5-0.8 TB/s of packed weight with a gather from the 16-entry code table, a nibble
extraction, a multiply and a rounding per weight). Three lookups: NIBBLE (that gather), PAIR
(`_codes`: one 8-byte gather per byte from a 256-entry table of both levels) and PRMT
(`nf4_lookup.py`, compiled CUDA only): per quant block a thread holds, its 16 dequantized values
are formed in registers (16 multiplies and roundings a block, not one a weight) and each weight is
looked up among them by byte permutes: no gather, no per-weight multiply. PRMT stays exact: codes
looked up in 16 bits with the block's partial sum scaled once would save only that table (32
instructions a block a thread holds, about 1 of ~5.5 a weight, half of them multiplies beside the
integer pipe the byte permutes fill) and be off the dequantized weight by up to 2^-7 relative (two
bf16 roundings of 2^-8), the product by up to 2^-7 sum_k |x_k w_k|: twice the output's own
rounding where nothing cancels, far more where the sum cancels. Where PRMT cannot run (the
interpreter, a code other than bitsandbytes' NF4 table, packed buffers not 4-byte aligned: see
`NF4Weight.register_table`) tiles asking for it run NIBBLE, the same values. PREFETCH loads the
next tile's bytes before decoding the current one, so their latency overlaps the decoding; STAGES
above 1 has Triton's pipeliner copy the next STAGES - 1 tiles into shared memory asynchronously
instead (no registers held for them). PARTS = 2 loads each block's bytes as two tensors of one
shape: a thread then holds whole blocks and builds each PRMT table once, not once per half (the
compiler splits one 32-byte load of a block across two threads). GROUPS = 2 (one row of x) loads
the tile's even and odd rows as two such tensors: a thread then holds a row of each at the same
columns, and loads and widens the x of those columns once for both.

Tiles (and the lookup) come from a measured plan where `bench/nf4_gemv_sweep.py` ran on the
device, else a cost model (`nf4_tiles.py`); the plan also says whether this kernel beats
bitsandbytes' one-row GEMV (which multiplies in bf16, not bit-exact with its own dequantize), and
`applies` takes one row only then (`NF4Weight.min_rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kestrel.kernels._utils import cdiv, interpreted
# Triton helpers by bare name: torch.compile rebuilds a kernel's helpers only so (test_compile_closure)
from kestrel.kernels.decode.nf4_lookup import block_values
from kestrel.kernels.decode.nf4_tiles import MAX_ROWS, NIBBLE, PAIR, PRMT, Tiles
from kestrel.kernels.decode.nf4_weight import (
    MAX_MEMBERS, MIN_ROWS, NF4Weight, code_pairs, decoded_absmax, dequantized, nf4_weight, unsupported,
)
from kestrel.kernels.dispatch import use_triton

__all__ = ["MAX_MEMBERS", "MAX_ROWS", "MIN_ROWS", "NIBBLE", "PAIR", "PRMT", "Tiles", "NF4Weight", "applies",
           "code_pairs", "decoded_absmax", "dequantized", "nf4_gemv", "nf4_gemv_reference", "nf4_weight", "unsupported"]



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
def _codes(packed, CODE, PAIRS, LOOKUP: tl.constexpr):
    """The NF4 levels of each byte's two elements, fp32 (hi: element 2j, the high nibble; lo:
    2j + 1). NIBBLE: one gather from the 16-entry table per element. PAIR: one 8-byte gather per
    byte from the 256-entry table of both levels (element 2j's fp32 bits in the low word), so no
    nibble is extracted and half the gathers are issued."""
    if LOOKUP == 1:
        pair = tl.load(PAIRS + packed.to(tl.int32))  # int64
        hi = pair.to(tl.int32).to(tl.float32, bitcast=True)
        lo = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        hi = tl.load(CODE + (packed >> 4).to(tl.int32))
        lo = tl.load(CODE + (packed & 15).to(tl.int32))
    return hi, lo


@triton.jit
def _tile(w_rows, s_rows, blk0, N_BLK: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr, MASKED: tl.constexpr,
          LOOKUP: tl.constexpr, PART: tl.constexpr = 0, PARTS: tl.constexpr = 1):
    """Part PART of PARTS of the packed bytes of quant blocks blk0 .. blk0 + NB - 1 of each row,
    (BLOCK_N, NB, HB / PARTS) uint8 (PRMT: int32 words (BLOCK_N, NB, HB / 4 / PARTS)), and their fp32
    absmax (BLOCK_N, NB); blocks at or past N_BLK read as zeros (checked only when MASKED)."""
    blk = blk0 + tl.arange(0, NB)  # (NB,)
    PER: tl.constexpr = (HB // 4 if LOOKUP == 2 else HB) // PARTS  # words or bytes of a block's part
    if LOOKUP == 2:  # rows start at multiples of K / 2 bytes, the buffers at multiples of 4 (`nf4_weight`)
        w_rows = w_rows.to(tl.pointer_type(tl.int32))
    byte = blk[:, None] * (PER * PARTS) + PART * PER + tl.arange(0, PER)[None, :]  # (NB, PER) offsets in a row
    if MASKED:
        ok = (blk < N_BLK)[None, :]
        packed = tl.load(w_rows[:, None, None] + byte[None, :, :], mask=ok[:, :, None], other=0)
        scale = tl.load(s_rows[:, None] + blk[None, :], mask=ok, other=0.0)
    else:
        packed = tl.load(w_rows[:, None, None] + byte[None, :, :])
        scale = tl.load(s_rows[:, None] + blk[None, :])
    return packed, scale


@triton.jit
def _tile_parts(w_rows, s_rows, blk0, N_BLK: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr,
                MASKED: tl.constexpr, LOOKUP: tl.constexpr, PARTS: tl.constexpr):
    """(first part, last part, absmax) of a tile (`_tile`); with one part both are the whole tile
    (one load: the compiler merges the two)."""
    packed, scale = _tile(w_rows, s_rows, blk0, N_BLK, NB, HB, MASKED, LOOKUP, 0, PARTS)
    last, _ = _tile(w_rows, s_rows, blk0, N_BLK, NB, HB, MASKED, LOOKUP, PARTS - 1, PARTS)
    return packed, last, scale


@triton.jit
def _weight_pairs(packed, scale, CODE, PAIRS, HB: tl.constexpr, LOOKUP: tl.constexpr, DTYPE: tl.constexpr,
                  INTERPRETED: tl.constexpr, FP32: tl.constexpr):
    """A tile from `_tile` dequantized: (hi, lo), each (BLOCK_N, NB, HB), hi[.., b, j] = element 2j
    of block b (byte j's high nibble), lo = element 2j + 1. FP32: PRMT may return the DTYPE values
    as fp32 (the one-row path's operands)."""
    if LOOKUP == 2:
        hi, lo = block_values(packed, scale, DTYPE, HB, FP32)
    else:
        hi, lo = _codes(packed, CODE, PAIRS, LOOKUP)
        scale = scale[:, :, None]
        hi, lo = _rounded(hi * scale, DTYPE, INTERPRETED), _rounded(lo * scale, DTYPE, INTERPRETED)
    return hi, lo


@triton.jit
def _fma_part(acc, packed, scale, X, blk0, CODE, PAIRS, N_BLK: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr,
              PART: tl.constexpr, PARTS: tl.constexpr, EVEN: tl.constexpr, LOOKUP: tl.constexpr, DTYPE: tl.constexpr,
              INTERPRETED: tl.constexpr):
    """acc (BLOCK_N, NB, HB / PARTS) fp32 plus part PART of a tile (`_tile`) times its columns of x."""
    HP: tl.constexpr = HB // PARTS  # bytes of a block's part
    hi, lo = _weight_pairs(packed, scale, CODE, PAIRS, HP, LOOKUP, DTYPE, INTERPRETED, True)
    blk = blk0 + tl.arange(0, NB)
    pair = tl.arange(0, HP)[:, None] * 2 + tl.arange(0, 2)[None, :]  # (HP, 2): columns 2j, 2j + 1 of the part
    cols = blk[:, None, None] * (2 * HB) + PART * 2 * HP + pair[None, :, :]  # (NB, HP, 2)
    if EVEN:
        x = tl.load(X + cols)
    else:
        x = tl.load(X + cols, mask=(blk < N_BLK)[:, None, None], other=0.0)
    x_even, x_odd = tl.split(x.to(tl.float32))  # (NB, HP) each
    acc += hi.to(tl.float32) * x_even[None, :, :]  # two fused multiply-adds a byte
    acc += lo.to(tl.float32) * x_odd[None, :, :]
    return acc


@triton.jit
def _fma_step(acc, w_rows, s_rows, X, blk0, CODE, PAIRS, N_BLK: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr,
              PARTS: tl.constexpr, EVEN: tl.constexpr, LOOKUP: tl.constexpr, DTYPE: tl.constexpr,
              INTERPRETED: tl.constexpr):
    """acc plus one tile step of the rows at w_rows / s_rows, its parts loaded and used in turn."""
    for part in tl.static_range(PARTS):
        packed, scale = _tile(w_rows, s_rows, blk0, N_BLK, NB, HB, not EVEN, LOOKUP, part, PARTS)
        acc = _fma_part(acc, packed, scale, X, blk0, CODE, PAIRS, N_BLK, NB, HB, part, PARTS, EVEN, LOOKUP, DTYPE,
                        INTERPRETED)
    return acc


@triton.jit
def _fma_rows(X, w_rows, s_rows, w_odd, s_odd, CODE, PAIRS, blk_first, BLOCK_N: tl.constexpr, N_BLK: tl.constexpr,
              NB: tl.constexpr, HB: tl.constexpr, STEPS: tl.constexpr, EVEN: tl.constexpr, LOOKUP: tl.constexpr,
              PREFETCH: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr, PARTS: tl.constexpr,
              STAGES: tl.constexpr, GROUPS: tl.constexpr):
    """(BLOCK_N, 1) fp32: one row of x times BLOCK_N weight rows over STEPS tiles of NB blocks.
    PREFETCH, STAGES, PARTS, GROUPS: the module docstring. GROUPS = 2: w_rows / s_rows point at the
    tile's even rows, w_odd / s_odd at its odd ones (else unused); like two parts, the two groups'
    tensors get one layout, so x is loaded and widened once for a thread's two rows."""
    acc = tl.zeros((BLOCK_N // GROUPS, NB, HB // PARTS), tl.float32)
    odd = tl.zeros((BLOCK_N // GROUPS, NB, HB // PARTS), tl.float32)  # the odd rows' (GROUPS = 2)
    if PREFETCH:  # (one group: `nf4_gemv` refuses two with it)
        packed, packed1, scale = _tile_parts(w_rows, s_rows, blk_first, N_BLK, NB, HB, True, LOOKUP, PARTS)
        for i in tl.range(STEPS, num_stages=STAGES):
            blk0 = blk_first + i * NB
            cur, cur1, cur_scale = packed, packed1, scale
            packed, packed1, scale = _tile_parts(w_rows, s_rows, blk0 + NB, N_BLK, NB, HB, True, LOOKUP,
                                                 PARTS)  # the last one unused
            acc = _fma_part(acc, cur, cur_scale, X, blk0, CODE, PAIRS, N_BLK, NB, HB, 0, PARTS, EVEN, LOOKUP, DTYPE,
                            INTERPRETED)
            if PARTS == 2:
                acc = _fma_part(acc, cur1, cur_scale, X, blk0, CODE, PAIRS, N_BLK, NB, HB, 1, PARTS, EVEN, LOOKUP,
                                DTYPE, INTERPRETED)
    else:
        for i in tl.range(STEPS, num_stages=STAGES):
            blk0 = blk_first + i * NB
            acc = _fma_step(acc, w_rows, s_rows, X, blk0, CODE, PAIRS, N_BLK, NB, HB, PARTS, EVEN, LOOKUP, DTYPE,
                            INTERPRETED)
            if GROUPS == 2:
                odd = _fma_step(odd, w_odd, s_odd, X, blk0, CODE, PAIRS, N_BLK, NB, HB, PARTS, EVEN, LOOKUP, DTYPE,
                                INTERPRETED)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if GROUPS == 2:  # (BLOCK_N / 2, 2) [r, g] -> row 2r + g
        y = tl.reshape(tl.join(y, tl.sum(tl.sum(odd, axis=2), axis=1)), (BLOCK_N,))
    return y[:, None]


@triton.jit
def _dot_part(acc, packed, scale, x_rows, m, M, blk0, CODE, PAIRS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              N_BLK: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr, PART: tl.constexpr, PARTS: tl.constexpr,
              LOOKUP: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc (BLOCK_N, BLOCK_M) fp32 plus part PART of a tile (`_tile`) times its columns of x, on
    tensor cores: the part's even and odd columns as two products of K = NB x HB / PARTS."""
    HP: tl.constexpr = HB // PARTS
    KP: tl.constexpr = NB * HP  # the columns of each product
    hi, lo = _weight_pairs(packed, scale, CODE, PAIRS, HP, LOOKUP, DTYPE, INTERPRETED, False)
    blk = blk0 + tl.arange(0, NB)
    cols = blk[:, None] * (2 * HB) + PART * 2 * HP + tl.arange(0, 2 * HP)[None, :]  # (NB, 2 HP)
    ok = (m < M)[:, None, None] & (blk < N_BLK)[None, :, None]
    x = tl.load(x_rows[:, None, None] + cols[None, :, :], mask=ok, other=0.0)  # (BLOCK_M, NB, 2 HP)
    x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, KP, 2)))
    hi = tl.reshape(hi, (BLOCK_N, KP))
    lo = tl.reshape(lo, (BLOCK_N, KP))
    if INTERPRETED:  # fp32 operands holding 16-bit values: exact products, as on the GPU
        acc = tl.dot(hi, tl.trans(x_even.to(tl.float32)), acc, input_precision="ieee")
        acc = tl.dot(lo, tl.trans(x_odd.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(hi, tl.trans(x_even), acc)
        acc = tl.dot(lo, tl.trans(x_odd), acc)
    return acc


@triton.jit
def _dot_rows(X, M, stride_x, w_rows, s_rows, CODE, PAIRS, blk_first, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, N_BLK: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr, STEPS: tl.constexpr,
              EVEN: tl.constexpr, LOOKUP: tl.constexpr, PREFETCH: tl.constexpr, DTYPE: tl.constexpr,
              INTERPRETED: tl.constexpr, PARTS: tl.constexpr, STAGES: tl.constexpr):
    """(BLOCK_N, BLOCK_M) fp32: the weight rows times up to BLOCK_M rows of x, on tensor cores
    (PREFETCH, STAGES, PARTS: the module docstring)."""
    m = tl.arange(0, BLOCK_M)
    x_rows = X + m.to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if PREFETCH:
        packed, packed1, scale = _tile_parts(w_rows, s_rows, blk_first, N_BLK, NB, HB, True, LOOKUP, PARTS)
    for i in tl.range(STEPS, num_stages=STAGES):
        blk0 = blk_first + i * NB
        if PREFETCH:
            cur, cur1, cur_scale = packed, packed1, scale
            packed, packed1, scale = _tile_parts(w_rows, s_rows, blk0 + NB, N_BLK, NB, HB, True, LOOKUP,
                                                 PARTS)  # the last one unused
        else:
            cur, cur1, cur_scale = _tile_parts(w_rows, s_rows, blk0, N_BLK, NB, HB, not EVEN, LOOKUP, PARTS)
        acc = _dot_part(acc, cur, cur_scale, x_rows, m, M, blk0, CODE, PAIRS, BLOCK_M, BLOCK_N, N_BLK, NB, HB, 0,
                        PARTS, LOOKUP, DTYPE, INTERPRETED)
        if PARTS == 2:
            acc = _dot_part(acc, cur1, cur_scale, x_rows, m, M, blk0, CODE, PAIRS, BLOCK_M, BLOCK_N, N_BLK, NB, HB, 1,
                            PARTS, LOOKUP, DTYPE, INTERPRETED)
    return acc


@triton.jit
def _store(y, Y, bias, rows, row_ok, M, stride_y, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y (BLOCK_N, BLOCK_M) fp32 (+ bias), rounded to Y's dtype, into Y[m, rows]."""
    if HAS_BIAS:
        y += bias[:, None]
    m = tl.arange(0, BLOCK_M)
    out = Y + m.to(tl.int64)[None, :] * stride_y + rows[:, None]
    tl.store(out, y.to(Y.dtype.element_ty), mask=row_ok[:, None] & (m < M)[None, :])


# M only masks rows of x: one compiled kernel serves every row count (Triton would otherwise compile
# M = 1 and multiples of 16 apart).
@triton.jit(do_not_specialize=["M"])
def _nf4_gemv_kernel(
    X, Y, PART, TICKETS,  # x (M, K); y (M, N); split-K fp32 partials; int32 tickets, zero between launches
    W0, W1, W2, S0, S1, S2, B0, B1, B2,  # per member: packed uint8, fp32 absmax, bias (unused ones repeat W0...)
    CODE, PAIRS,  # fp32 (16,) NF4 levels; int64 (256,) both levels of each byte (`_codes`)
    M, N, end0, end1, stride_x, stride_y,
    K: tl.constexpr, BS: tl.constexpr, MEMBERS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    LOOKUP: tl.constexpr, PREFETCH: tl.constexpr, INTERPRETED: tl.constexpr, PARTS: tl.constexpr = 1,
    STAGES: tl.constexpr = 1, GROUPS: tl.constexpr = 1,
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
    if BLOCK_M == 1 and GROUPS == 2:
        even = pid_n * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2)
        r0, r1 = tl.minimum(even, N - 1), tl.minimum(even + 1, N - 1)
        y = _fma_rows(X, _member_ptrs(r0, end0, end1, W0, W1, W2, K // 2, MEMBERS),
                      _member_ptrs(r0, end0, end1, S0, S1, S2, N_BLK, MEMBERS),
                      _member_ptrs(r1, end0, end1, W0, W1, W2, K // 2, MEMBERS),
                      _member_ptrs(r1, end0, end1, S0, S1, S2, N_BLK, MEMBERS), CODE, PAIRS, blk_first, BLOCK_N,
                      N_BLK, NB, HB, STEPS, EVEN, LOOKUP, PREFETCH, DTYPE, INTERPRETED, PARTS, STAGES, GROUPS)
    elif BLOCK_M == 1:
        y = _fma_rows(X, w_rows, s_rows, w_rows, s_rows, CODE, PAIRS, blk_first, BLOCK_N, N_BLK, NB, HB, STEPS, EVEN,
                      LOOKUP, PREFETCH, DTYPE, INTERPRETED, PARTS, STAGES, 1)
    else:
        y = _dot_rows(X, M, stride_x, w_rows, s_rows, CODE, PAIRS, blk_first, BLOCK_M, BLOCK_N, N_BLK, NB, HB, STEPS,
                      EVEN, LOOKUP, PREFETCH, DTYPE, INTERPRETED, PARTS, STAGES)
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


# --- host ------------------------------------------------------------------------------------------


def applies(x: torch.Tensor, weight: NF4Weight) -> bool:
    """True when the decode path should run this product here: `weight.min_rows` to MAX_ROWS rows of
    x in the weight's compute dtype, and the Triton kernels chosen (`kestrel.kernels.dispatch`: CUDA
    tensors, or forced). (`nf4_gemv` itself takes one row whatever `min_rows` says.)"""
    return (x.shape[-1] == weight.k and weight.min_rows <= rows_of(x) <= MAX_ROWS and x.dtype == weight.dtype
            and use_triton(x, weight.packed[0]))


def rows_of(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[-1])


def nf4_gemv(x: torch.Tensor, weight: NF4Weight, tiles: Tiles | None = None) -> torch.Tensor:
    """x (..., K) with at most MAX_ROWS rows, in `weight.dtype` -> (..., N) in x's dtype:
    x dequant(W)^T (+ bias), fp32 sums, rounded once. `tiles`: override `weight.tiles_for` (tests,
    the sweep).
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
    t = tiles or weight.tiles_for(m)
    lookup = NIBBLE if t.lookup == PRMT and (interpreted() or not weight.register_table) else t.lookup
    if (t.block_m == 1 and m > 1) or t.block_m not in (1, MAX_ROWS) or t.block_k % weight.blocksize \
            or t.parts not in (1, 2) or t.stages < 1 or t.groups not in (1, 2) \
            or (t.groups == 2 and (t.block_m > 1 or t.prefetch or t.block_n < 2)):
        raise ValueError(f"tiles {t} do not fit {m} rows of K = {k} in blocks of {weight.blocksize}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid_n = cdiv(n, t.block_n)
    part = torch.empty(grid_n * t.split * t.block_n * t.block_m if t.split > 1 else 1, dtype=torch.float32,
                       device=x.device)
    members = len(weight.sizes)
    w, s = _padded(weight.packed), _padded(weight.absmax)
    b = _padded(weight.bias) if weight.bias is not None else w
    ends = [sum(weight.sizes[: i + 1]) for i in range(MAX_MEMBERS - 1)]
    _nf4_gemv_kernel[(grid_n, t.split)](
        rows, y, part, weight.tickets, *w, *s, *b, weight.code, weight.pairs, m, n, ends[0], ends[1], rows.stride(0),
        y.stride(0), K=k, BS=weight.blocksize, MEMBERS=members, HAS_BIAS=weight.bias is not None, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT=t.split, LOOKUP=lookup, PREFETCH=t.prefetch,
        INTERPRETED=interpreted(), PARTS=t.parts, STAGES=t.stages, GROUPS=t.groups, num_warps=t.warps,
        num_stages=t.stages,
    )
    return y.view(*x.shape[:-1], n)


def _padded(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Exactly MAX_MEMBERS tensors: the unused pointer slots repeat the first (never read)."""
    return tensors + (tensors[0],) * (MAX_MEMBERS - len(tensors))


def nf4_gemv_reference(x: torch.Tensor, weight: NF4Weight) -> torch.Tensor:
    """x (..., K) -> (..., N): the dequantized 16-bit weight times x in fp32, rounded to x's dtype."""
    bias = None if weight.bias is None else torch.cat(weight.bias).float()
    return F.linear(x.float(), dequantized(weight).float(), bias).to(x.dtype)
