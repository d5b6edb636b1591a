"""Compile decode kernels for sm_90 without a GPU (Triton's NVIDIA backend and its ptxas), in a process
of its own: under TRITON_INTERPRET=1 the kernels are interpreted functions, which do not compile (and the
interpreter accepts what the compiler refuses, e.g. a plain global read inside a kernel).

    python -m tests.support.sm90_compile DTYPE BLOCK_M PREFETCH LOOKUP [PARTS STAGES GROUPS]
        # nf4_gemv: prints the PTX's prmt count and its cp.async count
    python -m tests.support.sm90_compile expert                          # expert_gemv: its variants' add.rn counts
    python -m tests.support.sm90_compile glu_lowrank                     # its kernels' tensor-core (mma) counts
"""

from __future__ import annotations

import sys


def compile_kernel(dtype: str, block_m: int, prefetch: bool, lookup: int, parts: int = 1, stages: int = 1,
                   groups: int = 1) -> str:
    """The PTX of `_nf4_gemv_kernel` for two members (37 + 24 rows, K = 320: a masked last step) with bias
    and split-K 2, compiled through ptxas for sm_90 (`bench.nf4_sass.compile_sm90`; raises where Triton or
    ptxas refuse it)."""
    from bench.nf4_sass import compile_sm90
    from kestrel.kernels.decode.nf4_tiles import Tiles

    tiles = Tiles(block_m, 16 if block_m > 1 else 4, 128, 2, 4, stages, lookup, prefetch, parts, groups)
    compiled = compile_sm90((37, 24), 320, tiles, dtype, bias=True)
    assert compiled.asm["cubin"], "no cubin"
    return compiled.asm["ptx"]


def compile_expert_kernel(dtype: str, nf4: bool, k_contig: bool, nested: bool, aligned: bool = True) -> str:
    """The PTX of `expert_gemv`'s kernel over 8 experts of (a, b) = (96, 320) in the stored layout (K
    contiguous: N = 96, K = 320; else K = 96, N = 320: masked last tiles either way), NF4 scales decoded
    once a 32-byte group (`aligned`) or once a byte, compiled through ptxas for sm_90 (raises where Triton
    or ptxas refuse it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kestrel.kernels.decode import expert_gemv

    table = ("fp32", "u8" if nested else "fp32", "fp32", "fp32", "fp32", "i64")  # CODE .. PAIRS
    ptrs = {"X": dtype, "IDS": "i64", "Y": dtype, "W": "u8" if nf4 else dtype}
    ptrs |= dict(zip(("CODE", "ABSMAX", "CODE2", "ABSMAX2", "OFFSET", "PAIRS"), table if nf4 else (dtype,) * 6))
    sig = {k: f"*{v}" for k, v in ptrs.items()} | dict.fromkeys(("stride_x", "stride_y"), "i32")
    n, k = (96, 320) if k_contig else (320, 96)
    consts = dict(N=n, K=k, STRIDE_E=96 * 320, STRIDE_ROW=320, K_CONTIG=k_contig, NF4=nf4, BS=64 if nf4 else 1,
                  BS2=256 if nested else 1, NESTED=nested, GROUP=32 if nf4 else 1, ALIGNED=nf4 and aligned,
                  BLOCK_N=2 if k_contig else 64,
                  BLOCK_K=256 if k_contig else 64, INTERPRETED=False)
    src = ASTSource(fn=expert_gemv._expert_gemv_kernel, signature=sig | dict.fromkeys(consts, "constexpr"),
                    constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"], "no cubin"
    return compiled.asm["ptx"]


def compile_glu_lowrank(backward: bool, dtype: str, gelu: bool, rank: int, tiles=None) -> str:
    """The PTX of `kestrel.kernels.glu_lowrank`'s kernel, forward or backward, for `dtype` operands and a rank of
    `rank` (its dot step as the launcher picks it), on `tiles` (default: its own), compiled through ptxas for sm_90 (raises where
    Triton or ptxas refuse it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kestrel.kernels import glu_lowrank as kernels

    names = ("X", "E", "G", "UE", "UG", "VE", "VG")
    sig: dict[str, str] = {}
    for name in names:
        sig |= {name: f"*{dtype}", f"{name.lower()}_stride": "i32"}
    sig |= dict.fromkeys(("n_rows", "n_cols"), "i32")
    tiles = tiles or kernels.DEFAULT_TILES
    consts = dict(GELU=gelu, BACKWARD=backward, RANK_E=rank, RANK_G=rank, STEP=kernels._rank_step(rank),
                  IEEE=dtype == "fp32", BM=tiles.rows, BN=tiles.cols, ROW_STEPS=tiles.row_steps)
    # As a launch specializes them: 16-byte aligned pointers, and row strides and a width (an MLP's I) in multiples
    # of 16 elements
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig)
               if name.upper() in names or "stride" in name or name == "n_cols"}
    src = ASTSource(fn=kernels._glu_kernel, signature=sig | dict.fromkeys(consts, "constexpr"), constexprs=consts,
                    attrs=aligned)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": tiles.warps})
    assert compiled.asm["cubin"], "no cubin"
    return compiled.asm["ptx"]


if __name__ == "__main__":
    if sys.argv[1] == "glu_lowrank":
        from kestrel.kernels.glu_lowrank import DEFAULT_TILES, Tiles

        variants = [(b, d, g, r, t) for t in (DEFAULT_TILES, Tiles(32, 128, 8, 4)) for b in (False, True)
                    for d, g, r in (("bf16", False, 16), ("bf16", True, 8), ("fp16", False, 64), ("fp32", False, 16))]
        ptx = [compile_glu_lowrank(*v) for v in variants]
        print(*(p.count("wgmma") + p.count("mma.sync") for p in ptx))
        print(*(p.count("ld.global.b16") + p.count("ld.global.nc.b16") for p in ptx))  # one 2-byte element a load
    elif sys.argv[1] == "expert":
        variants = [("bf16", False, True, False), ("bf16", False, False, False), ("bf16", True, True, True),
                    ("bf16", True, False, True), ("fp16", True, False, False, False), ("fp32", True, True, False, False)]
        print(*(compile_expert_kernel(*v).count("add.rn.f32") for v in variants))
    else:
        dtype, block_m, prefetch, lookup = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
        ptx = compile_kernel(dtype, block_m, prefetch, lookup, *(int(a) for a in sys.argv[5:8]))
        print(ptx.count("prmt.b32"), ptx.count("cp.async.cg") + ptx.count("cp.async.ca"))
