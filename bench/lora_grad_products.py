"""The adapters' weight-gradient products in fp32, timed at a model's shapes, and which kernel runs them.

    python bench/lora_grad_products.py --shape qwen2.5-7b --out grad_products.json

The backward of a rank-r adapter forms dA = dyb^T x (r, in) and dB = dy^T xa (out, r) from 16-bit
activations, each a long reduction over the M tokens into a tiny fp32 result (`kestrel.kernels.lora.lora`,
`_adapter_backward`). A Qwen2.5-7B QLoRA profile (bench/RESULTS.md, session 35) showed both Kestrel's and
Unsloth's running as fp32 SIMT kernels (`sm80_xmma_gemm_f32f32_f32f32_f32_..._ffma`, 392 a step, 9.4 ms) at
10-44 TFLOP/s. Ways timed here, each against the fp32 product of the same 16-bit values (the exact result):
- out_dtype: `torch.mm(a, b, out_dtype=torch.float32)` on 16-bit operands (what `casts.mm_to` runs);
- upcast_tf32: both operands upcast to fp32 and multiplied with TF32 allowed: 16-bit values are exact in
  TF32, so only the fp32 summation order differs;
- upcast_fp32: both upcast, TF32 off (the exact reference's own way);
- bf16_then_float: a 16-bit product rounded to 16 bits, then widened (not a candidate: it loses the
  result's low bits; timed for scale).
Per shape: microseconds a call (CUDA events, median), the largest relative error, and the kernel names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import cuda_time  # noqa: E402
from bench.model_shapes import MODELS  # noqa: E402


def product_shapes(name: str, tokens: int, r: int) -> dict[str, tuple[int, int, int]]:
    """(rows, K, cols) of each distinct dA / dB product of one decoder layer: dA_k = dyb_k^T x is
    (r, M) @ (M, in); dB = dy^T xa is (out, M) @ (M, r)."""
    cfg = MODELS[name]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    q_out, kv_out = heads * head_dim, kv * head_dim
    shapes = {
        "dA qkv/gate-up (in = hidden)": (r, tokens, hidden),
        "dA down (in = intermediate)": (r, tokens, inter),
        "dB q/o-like (out = hidden)": (hidden, tokens, r),
        "dB q (out = heads x head_dim)": (q_out, tokens, r),
        "dB k/v": (kv_out, tokens, r),
        "dB gate/up": (inter, tokens, r),
    }
    distinct: dict[str, tuple[int, int, int]] = {}
    for label, shape in shapes.items():  # one row per shape (q's often equals hidden)
        if shape not in distinct.values():
            distinct[label] = shape
    return distinct


def ways(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    def upcast(tf32: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            before = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            try:
                return a.float() @ b.float()
            finally:
                torch.backends.cuda.matmul.allow_tf32 = before
        return run

    return {
        "out_dtype": lambda: torch.mm(a, b, out_dtype=torch.float32),
        "upcast_tf32": upcast(True),
        "upcast_fp32": upcast(False),
        "bf16_then_float": lambda: (a @ b).float(),
    }


def kernel_names(fn: Callable[[], torch.Tensor]) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def measure(rows: int, k: int, cols: int, dtype: torch.dtype) -> dict[str, dict[str, object]]:
    # As `_adapter_backward` lays them out: the left operand a transposed view (dyb^T, dy^T), the right
    # one x (contiguous) or a projection's column span of the group's xa (M, 3 r).
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(k, rows, device="cuda", dtype=dtype, generator=gen).t()
    wide = 3 * cols if rows > cols else cols
    b = torch.randn(k, wide, device="cuda", dtype=dtype, generator=gen)[:, :cols]
    torch.backends.cuda.matmul.allow_tf32 = False
    exact = a.double() @ b.double()
    out = {}
    for name, fn in ways(a, b).items():
        got = fn().double()
        err = float((got - exact).abs().max() / exact.abs().max())
        out[name] = {"us": cuda_time(fn, warmup=5, iters=30) * 1e6, "max_rel_error": err, "kernels": kernel_names(fn)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(MODELS))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "shape": args.shape, "tokens": args.tokens, "rank": args.rank,
           "products": {}}
    for label, (rows, k, cols) in product_shapes(args.shape, args.tokens, args.rank).items():
        res["products"][label] = {"shape": [rows, k, cols], **measure(rows, k, cols, torch.bfloat16)}
        row = res["products"][label]
        print(f"{label:32s} {rows}x{k}x{cols}: " + "  ".join(
            f"{n} {row[n]['us']:.1f} us (err {row[n]['max_rel_error']:.1e})" for n in ways(torch.empty(0), torch.empty(0))),
            flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
