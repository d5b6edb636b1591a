"""Compile `nf4_gemv`'s kernel for sm_90 without a GPU (Triton's NVIDIA backend and its ptxas), in a
process of its own: under TRITON_INTERPRET=1 the kernels are interpreted functions, which do not compile.

    python -m tests.support.sm90_compile DTYPE BLOCK_M PREFETCH LOOKUP   # prints the PTX's prmt count
"""

from __future__ import annotations

import sys


def compile_kernel(dtype: str, block_m: int, prefetch: bool, lookup: int) -> str:
    """The PTX of `_nf4_gemv_kernel` for two members (K = 320: a masked last step) with bias and split-K 2,
    compiled through ptxas for sm_90 (raises where Triton or ptxas refuse it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kestrel.kernels.decode import nf4_gemv

    ptrs = {"X": dtype, "Y": dtype, "PART": "fp32", "TICKETS": "i32", "W0": "u8", "W1": "u8", "W2": "u8",
            "S0": "fp32", "S1": "fp32", "S2": "fp32", "B0": dtype, "B1": dtype, "B2": dtype, "CODE": "fp32",
            "PAIRS": "i64"}
    sig = {k: f"*{v}" for k, v in ptrs.items()} | dict.fromkeys(("M", "N", "end0", "end1", "stride_x", "stride_y"), "i32")
    consts = dict(K=320, BS=64, MEMBERS=2, HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=16 if block_m > 1 else 4,
                  BLOCK_K=128, SPLIT=2, LOOKUP=lookup, PREFETCH=prefetch, INTERPRETED=False)
    src = ASTSource(fn=nf4_gemv._nf4_gemv_kernel, signature=sig | dict.fromkeys(consts, "constexpr"), constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"], "no cubin"
    return compiled.asm["ptx"]


if __name__ == "__main__":
    dtype, block_m, prefetch, lookup = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    print(compile_kernel(dtype, block_m, prefetch, lookup).count("prmt.b32"))
