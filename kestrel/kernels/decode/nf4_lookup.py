"""Gather-free NF4 decoding for `nf4_gemv.py` (lookup PRMT): a quant block's 16 dequantized values
held in registers, looked up with PTX `prmt.b32` (byte permute), no shared memory, no gather.

Per (row, quant block) the block table: the 16 values v_i = DTYPE(code_i * absmax), the product in
fp32 rounded once (`mul.rn.f32` by the code as an immediate, `cvt.rn.{bf16,f16}x2.f32`): exactly
what bitsandbytes' dequantize writes, so the product stays the dequantized 16-bit product. The
table is two byte planes (the low and the high byte of each v_i), four registers each: plane p's
register g holds byte p of v_4g .. v_4g+3 (byte 0 = v_4g). Building it is 16 mul + 8 cvt + 8 prmt
per block a thread holds (32 or 64 of its values, as Triton lays the tile out).

Per 32-bit word of packed nibbles (8 consecutive elements of one block, little-endian: element 2i
in the HIGH nibble of byte i, 2i + 1 in the low one), `prmt.b32 d, a, b, c` builds each byte n of d
from byte (c >> 4n) & 7 of the 8 bytes {b, a}; bit 3 of that selector nibble asks for the byte's
sign replicated instead (so it must be clear), and c's high 16 bits are not read. The word's low
16 bits are four nibbles, elements (1, 0, 3, 2), already a selector; its high 16 bits elements
(5, 4, 7, 6). For each half and plane, prmt(plane[0], plane[1], s & 0x7777) looks up codes 0-7,
prmt(plane[2], plane[3], s & 0x7777) codes 8-15, and prmt(low, high, 0x3210 | ((s >> 1) & 0x4444))
keeps the second where the nibble's bit 3 is set; two more prmt per half pair the planes into the
16-bit pairs the kernel's tiles hold side by side. 21 integer operations per 8 values
(`lookup_program`: 16 prmt, 5 for the selectors) against a gather, an extraction, a multiply and a
rounding per value. For the one-row path's fp32 multiply-adds the pairs are widened in the same asm
(bf16: a shift and a mask; fp16: cvt), so no 16-bit half is extracted first.

Both programs are written once as data (`Program`): `ptx` renders them for
`tl.inline_asm_elementwise`, `emulate` runs the same instructions with torch integer ops (the
CPU test of the byte and nibble order; Triton's interpreter cannot run inline PTX, so the
interpreted kernel keeps the gathers). The code values are bitsandbytes' NF4 table
(`nf4.NF4_CODE`) as immediates: a weight with any other code takes the NIBBLE lookup.
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from kestrel.kernels.nf4 import NF4_CODE

Operand = str | int  # a register name, or an immediate (u32 bits)


class Instr(NamedTuple):
    # mul (fp32, rn), cvt2 (two fp32 -> 16-bit pair: first src upper), prmt, and, andor ((a & b) | c), shr, mov,
    # split (a 16-bit pair into its halves), widen (a 16-bit pair into the fp32 values of its halves)
    op: str
    dst: tuple[str, ...]  # split, widen: (low half's, high half's); every other op one register
    src: tuple[Operand, ...]


class Program(NamedTuple):
    inputs: tuple[str, ...]  # 32-bit registers
    outputs: tuple[str, ...]
    out_bits: int  # 32, or 16 (outputs written by split)
    body: tuple[Instr, ...]


def table_program(dtype: torch.dtype, code: Sequence[float] = NF4_CODE) -> Program:
    """fp32 absmax `a` -> the block table t0..t7 (module docstring): t_g = low bytes of v_4g..v_4g+3,
    t_4+g their high bytes, v_i = dtype(code_i * a)."""
    bits = [struct.unpack("<I", struct.pack("<f", c))[0] for c in code]
    body = [Instr("mul", (f"p{i}",), ("a", b)) for i, b in enumerate(bits)]
    body += [Instr("cvt2", (f"r{k}",), (f"p{2 * k + 1}", f"p{2 * k}")) for k in range(8)]  # low half: v_2k
    body += [Instr("prmt", (f"t{4 * plane + g}",), (f"r{2 * g}", f"r{2 * g + 1}", 0x7531 if plane else 0x6420))
             for plane in (0, 1) for g in range(4)]
    return Program(("a",), tuple(f"t{i}" for i in range(8)), 32, tuple(body))


def lookup_program(widen: bool = False) -> Program:
    """A packed word `q` and the block table t0..t7 -> o0..o7, element e's 16-bit value (`widen`: that
    value as fp32, for the one-row path's fp32 multiply-adds)."""
    # prmt reads its selector's low 16 bits only: the high halves need a shift, no mask
    body = [Instr("and", ("sA",), ("q", 0x77777777)), Instr("shr", ("sB",), ("sA", 16)),
            Instr("mov", ("k",), (0x32103210,)),  # in a register: one lop3 takes it and the mask
            Instr("shr", ("cA",), ("q", 1)),  # bit 3 of each nibble -> 4 added to byte n's index n
            Instr("andor", ("cA",), ("cA", 0x44444444, "k")), Instr("shr", ("cB",), ("cA", 16))]
    for half, first in (("A", 0), ("B", 4)):  # byte n of P0, P1: elements first + (1, 0, 3, 2)[n]
        for plane in (0, 1):
            t = [f"t{4 * plane + g}" for g in range(4)]
            body += [Instr("prmt", ("lo",), (t[0], t[1], f"s{half}")), Instr("prmt", ("hi",), (t[2], t[3], f"s{half}")),
                     Instr("prmt", (f"P{plane}",), ("lo", "hi", f"c{half}"))]
        # the pairs the kernel's halves hold side by side (`interleave`): elements (first, first + 2), (first + 1, first + 3)
        unpack = "widen" if widen else "split"
        body += [Instr("prmt", ("X",), ("P0", "P1", 0x7351)), Instr(unpack, (f"o{first}", f"o{first + 2}"), ("X",)),
                 Instr("prmt", ("Y",), ("P0", "P1", 0x6240)), Instr(unpack, (f"o{first + 1}", f"o{first + 3}"), ("Y",))]
    outputs = tuple(f"o{e}" for e in range(8))
    return Program(("q", *(f"t{i}" for i in range(8))), outputs, 32 if widen else 16, tuple(body))


# --- PTX ------------------------------------------------------------------------------------------


def ptx(program: Program, dtype: torch.dtype | None = None) -> tuple[str, str]:
    """(asm, constraints) for `tl.inline_asm_elementwise(..., pack=1)`: outputs $0.., then inputs;
    every other register a local .b32. `dtype`: the 16-bit type of cvt2 and widen (bf16 or fp16)."""
    names = {r: f"${i}" for i, r in enumerate(program.outputs + program.inputs)}
    temps = sorted({d for ins in program.body for d in ins.dst} - set(names))
    reg = {**names, **{t: f"%kn_{t}" for t in temps}}
    cvt = "bf16x2" if dtype == torch.bfloat16 else "f16x2"

    def arg(x: Operand, f32: bool = False) -> str:
        return reg[x] if isinstance(x, str) else (f"0f{x:08X}" if f32 else f"0x{x:X}")

    lines = [f".reg .b32 {', '.join(reg[t] for t in temps)};"]
    for ins in program.body:
        d = ", ".join(reg[x] for x in ins.dst)
        if ins.op == "mul":
            lines.append(f"mul.rn.f32 {d}, {arg(ins.src[0])}, {arg(ins.src[1], f32=True)};")
        elif ins.op == "cvt2":
            lines.append(f"cvt.rn.{cvt}.f32 {d}, {arg(ins.src[0])}, {arg(ins.src[1])};")
        elif ins.op == "split":
            lines.append(f"mov.b32 {{{d}}}, {arg(ins.src[0])};")
        elif ins.op == "widen" and dtype == torch.bfloat16:  # bf16 is fp32's high half
            lo, hi = (reg[x] for x in ins.dst)
            lines += [f"shl.b32 {lo}, {arg(ins.src[0])}, 16;", f"and.b32 {hi}, {arg(ins.src[0])}, 0xFFFF0000;"]
        elif ins.op == "widen":
            lo, hi = (reg[x] for x in ins.dst)
            lines.append(f"{{ .reg .b16 %kn_l, %kn_h; mov.b32 {{%kn_l, %kn_h}}, {arg(ins.src[0])}; "
                         f"cvt.f32.f16 {lo}, %kn_l; cvt.f32.f16 {hi}, %kn_h; }}")
        elif ins.op == "shr":
            lines.append(f"shr.u32 {d}, {arg(ins.src[0])}, {ins.src[1]};")
        elif ins.op == "andor":  # lop3's table for (a & b) | c: 0xF0 & 0xCC | 0xAA
            lines.append(f"lop3.b32 {d}, {', '.join(arg(x) for x in ins.src)}, 0xEA;")
        elif ins.op == "mov":
            lines.append(f"mov.b32 {d}, {arg(ins.src[0])};")
        else:  # prmt, and
            lines.append(f"{ins.op}.b32 {d}, {', '.join(arg(x) for x in ins.src)};")
    out = "=h" if program.out_bits == 16 else "=r"
    constraints = ",".join([out] * len(program.outputs) + ["r"] * len(program.inputs))
    # One line: torch.compile's inductor writes this constexpr into a module it generates, and some
    # versions quote it without escaping newlines (PTX ends each statement at ';' anyway).
    return "{ " + " ".join(lines) + " }", constraints


_TABLE_BF16 = ptx(table_program(torch.bfloat16), torch.bfloat16)
_TABLE_FP16 = ptx(table_program(torch.float16), torch.float16)
_LOOKUP = ptx(lookup_program())
_LOOKUP_F32_BF16 = ptx(lookup_program(widen=True), torch.bfloat16)
_LOOKUP_F32_FP16 = ptx(lookup_program(widen=True), torch.float16)
TABLE_BF16_ASM, TABLE_BF16_CONSTRAINTS = tl.constexpr(_TABLE_BF16[0]), tl.constexpr(_TABLE_BF16[1])
TABLE_FP16_ASM, TABLE_FP16_CONSTRAINTS = tl.constexpr(_TABLE_FP16[0]), tl.constexpr(_TABLE_FP16[1])
LOOKUP_ASM, LOOKUP_CONSTRAINTS = tl.constexpr(_LOOKUP[0]), tl.constexpr(_LOOKUP[1])
LOOKUP_F32_BF16_ASM, LOOKUP_F32_BF16_CONSTRAINTS = tl.constexpr(_LOOKUP_F32_BF16[0]), tl.constexpr(_LOOKUP_F32_BF16[1])
LOOKUP_F32_FP16_ASM, LOOKUP_F32_FP16_CONSTRAINTS = tl.constexpr(_LOOKUP_F32_FP16[0]), tl.constexpr(_LOOKUP_F32_FP16[1])


@triton.jit
def block_values(words, scale, DTYPE: tl.constexpr, HB: tl.constexpr, FP32: tl.constexpr):
    """words int32 (BLOCK_N, NB, HB / 4) of packed nibbles, scale fp32 (BLOCK_N, NB) -> (hi, lo),
    each (BLOCK_N, NB, HB): hi[.., j] = element 2j of the block, lo = element 2j + 1; DTYPE values,
    or (FP32) those values as fp32."""
    # The scale laid out as the words are (a reduction's result takes its input's layout, sliced): the
    # table is then built by the threads that read it, not moved to them through shared memory.
    scale = tl.max(tl.broadcast_to(scale[:, :, None], words.shape), axis=2)
    # (the output types spelled out in each branch: a constexpr dtype is refused there)
    if DTYPE == tl.bfloat16:
        t = tl.inline_asm_elementwise(TABLE_BF16_ASM, TABLE_BF16_CONSTRAINTS, [scale], dtype=(tl.int32,) * 8,
                                      is_pure=True, pack=1)
        if FP32:
            o = tl.inline_asm_elementwise(LOOKUP_F32_BF16_ASM, LOOKUP_F32_BF16_CONSTRAINTS, _lookup_args(words, t),
                                          dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            o = tl.inline_asm_elementwise(LOOKUP_ASM, LOOKUP_CONSTRAINTS, _lookup_args(words, t),
                                          dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        t = tl.inline_asm_elementwise(TABLE_FP16_ASM, TABLE_FP16_CONSTRAINTS, [scale], dtype=(tl.int32,) * 8,
                                      is_pure=True, pack=1)
        if FP32:
            o = tl.inline_asm_elementwise(LOOKUP_F32_FP16_ASM, LOOKUP_F32_FP16_CONSTRAINTS, _lookup_args(words, t),
                                          dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            o = tl.inline_asm_elementwise(LOOKUP_ASM, LOOKUP_CONSTRAINTS, _lookup_args(words, t),
                                          dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    return interleave(o, HB)


@triton.jit
def interleave(o, HB: tl.constexpr):
    """o: 8 tensors (BLOCK_N, NB, HB / 4), o[e][.., w] = element 8w + e of the block -> (hi, lo), each
    (BLOCK_N, NB, HB): hi[.., 4w + i] = o[2i][.., w], lo[.., 4w + i] = o[2i + 1][.., w]."""
    shape: tl.constexpr = (o[0].shape[0], o[0].shape[1], HB)
    # join(join(A, B), join(C, D))[.., w, a, b] is (A, B, C, D)[2b + a], at 4w + 2a + b of the reshape
    hi = tl.reshape(tl.join(tl.join(o[0], o[4]), tl.join(o[2], o[6])), shape)
    lo = tl.reshape(tl.join(tl.join(o[1], o[5]), tl.join(o[3], o[7])), shape)
    return hi, lo


@triton.jit
def _lookup_args(words, t):
    """The lookup's inputs: the words (BLOCK_N, NB, W), then the 8 table registers of their block."""
    return (words, t[0][:, :, None], t[1][:, :, None], t[2][:, :, None], t[3][:, :, None], t[4][:, :, None],
            t[5][:, :, None], t[6][:, :, None], t[7][:, :, None])


# --- emulation (torch) -----------------------------------------------------------------------------


def emulate(program: Program, inputs: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Run `program` on int64 tensors holding u32 register values (same shape), as the PTX would:
    prmt with its sign mode, fp32 mul and 16-bit cvt rounded to nearest even (`dtype`: cvt2's and
    widen's 16-bit type). Returns the outputs (16-bit ones as u16 values)."""
    regs = {k: v.to(torch.int64) & 0xFFFFFFFF for k, v in inputs.items()}
    for ins in program.body:
        src = [regs[x] if isinstance(x, str) else torch.full_like(regs[program.inputs[0]], x) for x in ins.src]
        if ins.op == "mul":
            out = _bits(_f32(src[0]) * _f32(src[1]))
        elif ins.op == "cvt2":
            out = (_u16(_f32(src[0]), dtype) << 16) | _u16(_f32(src[1]), dtype)
        elif ins.op in ("split", "widen"):
            halves = src[0] & 0xFFFF, src[0] >> 16
            if ins.op == "widen":
                halves = tuple(_bits(h.to(torch.int16).view(dtype).float()) for h in halves)
            regs[ins.dst[0]], regs[ins.dst[1]] = halves
            continue
        elif ins.op == "prmt":
            out = prmt(*src)
        else:
            out = {"and": lambda a, b: a & b, "andor": lambda a, b, c: (a & b) | c, "shr": lambda a, b: a >> b,
                   "mov": lambda a: a}[ins.op](*src)
        regs[ins.dst[0]] = out & 0xFFFFFFFF
    return {k: regs[k] for k in program.outputs}


def prmt(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """PTX prmt.b32 (default mode) on u32 values in int64: byte n of the result is byte
    (c >> 4n) & 7 of {b, a} (a's bytes 0-3, b's 4-7), or that byte's top bit replicated when bit 3
    of the selector nibble is set. Only c's low 16 bits are read."""
    out = torch.zeros_like(a)
    for n in range(4):
        sel = (c >> (4 * n)) & 0xF
        idx = sel & 7
        byte = torch.where(idx < 4, a >> (8 * (idx % 4)), b >> (8 * (idx % 4))) & 0xFF
        byte = torch.where(sel >= 8, torch.where(byte >= 0x80, 0xFF, 0), byte)
        out |= byte << (8 * n)
    return out


def _f32(u: torch.Tensor) -> torch.Tensor:
    return u.to(torch.int32).view(torch.float32)  # the low 32 bits, wrapped into int32 first


def _bits(f: torch.Tensor) -> torch.Tensor:
    return f.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _u16(f: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return f.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
