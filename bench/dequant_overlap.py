"""Does NF4 dequantization on a side stream overlap with the matrix product on the main one?

    python bench/dequant_overlap.py

Times, at the 8B QLoRA shapes (4,096 tokens): the product alone, the dequantization alone, the
two in sequence on one stream, and the product with the NEXT weight's dequantization running
concurrently on a second stream (what a prefetching dequantizer would do).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import cuda_time  # noqa: E402
from kestrel.kernels import nf4  # noqa: E402


def main() -> None:
    import bitsandbytes.functional as bnbf

    side = torch.cuda.Stream()
    for out_f, in_f in [(14336, 4096), (4096, 14336), (4096, 4096)]:
        w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
        packed, state = bnbf.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
        x = torch.randn(4096, in_f, device="cuda", dtype=torch.bfloat16)
        a, b = torch.empty_like(w), torch.empty_like(w)
        nf4.dequantize(packed, state, out=a)

        def gemm():
            torch.mm(x, a.t())

        def deq():
            nf4.dequantize(packed, state, out=b)

        def serial():
            deq()
            gemm()

        def overlapped():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                deq()
            gemm()
            torch.cuda.current_stream().wait_stream(side)

        t = {name: cuda_time(fn, warmup=5, iters=30) * 1e6 for name, fn in
             [("gemm", gemm), ("dequant", deq), ("serial", serial), ("overlapped", overlapped)]}
        print(f"({out_f}, {in_f}): " + ", ".join(f"{k} {v:.0f} us" for k, v in t.items()), flush=True)


if __name__ == "__main__":
    main()
