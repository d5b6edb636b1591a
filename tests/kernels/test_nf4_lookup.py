"""The gather-free NF4 lookup (kernels/decode/nf4_lookup.py) on the CPU.

The PTX programs run through `emulate` (the same instruction list the asm is rendered from, with
prmt's sign mode modelled): every byte value at every byte position of a packed word, several
block scales, bf16 and fp16, must give bitsandbytes' dequantized values in its nibble order
(element 2j in the HIGH nibble of byte j); programs with a selector or byte order broken on
purpose must not. Where Triton's NVIDIA backend is installed, the kernel with the PRMT lookup is
compiled for sm_90 (ptxas checks the asm). The interpreted kernel falls back to the gathers.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kestrel.kernels import nf4
from kestrel.kernels.decode import nf4_lookup
from kestrel.kernels.decode.nf4_gemv import NIBBLE, PRMT, Tiles, nf4_gemv, nf4_weight
from kestrel.kernels.decode.nf4_lookup import Instr, Program, emulate, lookup_program, prmt, table_program

bnb_functional = pytest.importorskip("bitsandbytes.functional")

ROOT = Path(__file__).resolve().parents[2]
SCALES = (1.0, 0.0123, 3.7, 2.0**-20, 1234.5)  # one quant block each


def _words() -> torch.Tensor:
    """int64 (4 * 256,) u32 words: byte position p of word w holds (w + 67 p) % 256, so every byte
    value appears at every position."""
    w = torch.arange(256)
    return torch.cat([sum(((w + 67 * p + 64 * r) % 256) << (8 * p) for p in range(4)) for r in range(4)])


def _expected(words: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """(len(words), 8) u16 bits: bitsandbytes' dequantize of the words' bytes in memory order."""
    packed = torch.stack([(words >> (8 * p)) & 0xFF for p in range(4)], dim=1).reshape(-1).to(torch.uint8)
    n = packed.numel() * 2
    state = bnb_functional.QuantState(absmax=torch.full((n // 64,), scale), shape=torch.Size((n,)),
                                      code=torch.tensor(nf4.NF4_CODE), blocksize=64, quant_type="nf4", dtype=dtype)
    values = bnb_functional.dequantize_4bit(packed, state)
    return values.view(torch.int16).to(torch.int64).reshape(-1, 8) & 0xFFFF


def _run(dtype: torch.dtype, scale: float, table: Program | None = None, lookup: Program | None = None) -> torch.Tensor:
    """(words, 8) u16 bits of elements 0..7 of each word (u32 fp32 bits with a widening lookup),
    through the emulated programs."""
    words = _words()
    a = torch.tensor([scale], dtype=torch.float32).view(torch.int32).to(torch.int64).expand(words.shape)
    t = emulate(table or table_program(dtype), {"a": a}, dtype)
    o = emulate(lookup or lookup_program(), {"q": words, **t}, dtype)
    return torch.stack([o[f"o{e}"] for e in range(8)], dim=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", SCALES)
def test_emulated_lookup_is_bitsandbytes_dequantize(dtype: torch.dtype, scale: float) -> None:
    expected = _expected(_words(), dtype, scale)
    code = torch.tensor(nf4.NF4_CODE)
    assert torch.equal(expected[:, 0], (code[(_words() >> 4) & 15] * scale).to(dtype).view(torch.int16).long() & 0xFFFF)
    assert torch.equal(_run(dtype, scale), expected)
    widened = _run(dtype, scale, lookup=lookup_program(widen=True))  # the one-row path's fp32 operands
    as_f32 = expected.to(torch.int16).view(dtype).float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(widened, as_f32)


def _broken(program: Program, op: str, src: tuple, new: tuple) -> Program:
    body = tuple(i._replace(src=new) if i.op == op and i.src == src else i for i in program.body)
    assert body != program.body, (op, src)
    return program._replace(body=body)


@pytest.mark.parametrize("case", ["sign-bit-kept", "halves-swapped", "planes-swapped", "pair-order", "high-select"])
def test_emulation_catches_broken_selectors(case: str) -> None:
    """Each mistake the asm could hold changes some value: the test above cannot pass by accident."""
    lookup, table = lookup_program(), table_program(torch.bfloat16)
    if case == "sign-bit-kept":  # bit 3 of the selector nibbles left set: prmt's sign mode
        lookup = _broken(lookup, "and", ("q", 0x77777777), ("q", 0xFFFFFFFF))
    elif case == "halves-swapped":  # the low 16 bits' elements looked up for the high ones too
        lookup = _broken(lookup, "shr", ("sA", 16), ("sA", 0))
    elif case == "planes-swapped":  # the table's low and high bytes exchanged
        table = _broken(table, "prmt", ("r0", "r1", 0x6420), ("r0", "r1", 0x7531))
    elif case == "pair-order":  # elements 2j and 2j + 1 exchanged
        lookup = _broken(lookup, "prmt", ("P0", "P1", 0x7351), ("P0", "P1", 0x5173))
    else:  # the select's bit taken from the wrong nibble bit
        lookup = _broken(lookup, "shr", ("q", 1), ("q", 2))
    assert not torch.equal(_run(torch.bfloat16, 0.37, table, lookup), _expected(_words(), torch.bfloat16, 0.37))


def test_prmt_emulation_follows_the_ptx_definition() -> None:
    a, b = torch.tensor([0x03020100]), torch.tensor([0x87868584])
    assert prmt(a, b, torch.tensor([0x3210])).item() == 0x03020100
    assert prmt(a, b, torch.tensor([0x4567])).item() == 0x84858687
    assert prmt(a, b, torch.tensor([0xC0F0])).item() == 0xFF00FF00  # sign mode: bytes 4 and 7's top bits (set)
    assert prmt(a, b, torch.tensor([0xB1B1])).item() == 0x00010001  # byte 3's (clear)
    assert prmt(a, b, torch.tensor([0x12340000 | 0x3210])).item() == 0x03020100  # high 16 bits unread


def test_ptx_names_every_register_once() -> None:
    asm, constraints = nf4_lookup.ptx(lookup_program())
    assert constraints == ",".join(["=h"] * 8 + ["r"] * 9)
    assert asm.count("prmt.b32") == 16 and "$17" not in asm and "$16" in asm
    asm, constraints = nf4_lookup.ptx(lookup_program(widen=True), torch.float16)
    assert constraints == ",".join(["=r"] * 8 + ["r"] * 9) and asm.count("cvt.f32.f16") == 8
    asm, constraints = nf4_lookup.ptx(table_program(torch.float16), torch.float16)
    assert asm.count("mul.rn.f32") == 16 and asm.count("cvt.rn.f16x2.f32") == 8 and constraints.count("=r") == 8
    with pytest.raises(KeyError):
        nf4_lookup.ptx(Program(("q",), ("o",), 32, (Instr("and", ("o",), ("missing", 1)),)))


@triton.jit
def _interleave_kernel(O, HI, LO, BN: tl.constexpr, NB: tl.constexpr, W: tl.constexpr):
    row = tl.arange(0, BN)[:, None, None] * NB + tl.arange(0, NB)[None, :, None]  # (BN, NB, 1)
    idx = row * W + tl.arange(0, W)[None, None, :]
    o = (tl.load(O + idx), tl.load(O + 1 * BN * NB * W + idx), tl.load(O + 2 * BN * NB * W + idx),
         tl.load(O + 3 * BN * NB * W + idx), tl.load(O + 4 * BN * NB * W + idx), tl.load(O + 5 * BN * NB * W + idx),
         tl.load(O + 6 * BN * NB * W + idx), tl.load(O + 7 * BN * NB * W + idx))
    hi, lo = nf4_lookup.interleave(o, 4 * W)
    out = row * 4 * W + tl.arange(0, 4 * W)[None, None, :]
    tl.store(HI + out, hi)
    tl.store(LO + out, lo)


def test_interleave_puts_each_word_element_in_its_place() -> None:
    """The lookup's eight outputs back in memory order (the kernel's hi/lo halves), through the
    same Triton function the compiled kernel calls (interpreted here)."""
    bn, nb, w = 2, 2, 8  # 64-element blocks: 8 words of 8
    e, rows, words = torch.meshgrid(torch.arange(8), torch.arange(bn * nb), torch.arange(w), indexing="ij")
    o = (8 * words + e + 1000 * rows).float().reshape(8, bn, nb, w)  # element 8w + e of block `rows`
    hi, lo = torch.empty(bn, nb, 4 * w), torch.empty(bn, nb, 4 * w)
    _interleave_kernel[(1,)](o, hi, lo, BN=bn, NB=nb, W=w)
    element = torch.arange(64).view(32, 2) + 1000 * torch.arange(bn * nb).view(-1, 1, 1)  # (blocks, 32, 2)
    assert torch.equal(hi, element[..., 0].view(bn, nb, 32).float())
    assert torch.equal(lo, element[..., 1].view(bn, nb, 32).float())


def test_interpreted_kernel_falls_back_to_the_gathers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles asking for PRMT run NIBBLE where inline PTX cannot (the interpreter, another code)."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU interpreter's fallback")
    gen = torch.Generator().manual_seed(0)
    packed, state = bnb_functional.quantize_4bit(torch.randn(24, 128, generator=gen).to(torch.bfloat16),
                                                 quant_type="nf4")
    weight = nf4_weight([(packed, state, None)], torch.bfloat16)
    assert weight.register_table
    x = torch.randn(1, 128, generator=gen).to(torch.bfloat16)
    tiles = Tiles(1, 8, 128, 1, lookup=PRMT)
    assert torch.equal(nf4_gemv(x, weight, tiles), nf4_gemv(x, weight, tiles._replace(lookup=NIBBLE)))
    state.code = state.code.clone()
    state.code[3] += 1e-3
    assert not nf4_weight([(packed, state, None)], torch.bfloat16).register_table


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="no Triton NVIDIA backend")
@pytest.mark.parametrize("dtype,block_m,prefetch,parts,stages,groups", [
    ("bf16", 16, False, 1, 1, 1), ("fp16", 16, True, 1, 1, 1), ("fp16", 1, True, 1, 1, 1), ("bf16", 1, False, 1, 1, 1),
    ("bf16", 1, True, 2, 1, 1), ("bf16", 1, False, 2, 3, 1), ("fp16", 16, False, 2, 3, 1), ("bf16", 1, False, 2, 2, 2)])
def test_prmt_kernel_compiles_for_sm90(dtype: str, block_m: int, prefetch: bool, parts: int, stages: int,
                                       groups: int) -> None:
    """The whole kernel with the PRMT lookup through Triton and ptxas for an H100/H200 (no GPU needed;
    its own process, uninterpreted): the lookup's 16 prmt and the table's 8 are in the PTX, and with
    STAGES > 1 the packed bytes are copied ahead asynchronously (cp.async), on either path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.support.sm90_compile", dtype, str(block_m), str(int(prefetch)),
                           str(PRMT), str(parts), str(stages), str(groups)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    prmt, copies = (int(v) for v in done.stdout.split()[-2:])
    assert prmt >= 16 + 8
    assert (copies > 0) == (stages > 1)
