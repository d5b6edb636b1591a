"""Batch-1 decode kernels at the Llama-3.1-8B shapes, each timed alone: the plain matrix-vector
product (kernels/gemv.py) against the same product with its epilogue (kernels/gemv_fused.py),
over a few rows-per-program settings, and the decode attention kernel against the
matmul-softmax-matmul reference. Weights rotate over copies so L2 never holds them (as in a real
step, where 15 GB stream by); each figure is a CUDA graph of many launches, per launch.

    python bench/decode_kernels.py --out decode_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # before bench/kernels.py shadows the package

from kestrel.kernels.decode import attention as da  # noqa: E402
from kestrel.kernels.decode import gemv_fused as gf  # noqa: E402
from kestrel.kernels.decode.attention import decode_attention, decode_attention_reference  # noqa: E402
from kestrel.kernels.decode.gemv import _gemv_kernel, gemv  # noqa: E402

HIDDEN, INTER, HEADS, KV, D = 4096, 14336, 32, 8, 128
COPIES, LAUNCHES = 8, 64


def timed(fn: Callable[[int], object]) -> float:
    """us per launch of fn(i) over LAUNCHES launches captured in one CUDA graph."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * LAUNCHES)


def weights(n: int, k: int) -> list[torch.Tensor]:
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(COPIES)]


def products(rows: list[dict]) -> None:
    x = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    m_in = torch.randn(INTER, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    sums = torch.zeros(COPIES, device="cuda")
    qkv, o, gu, down = (weights(n, k) for n, k in [((HEADS + 2 * KV) * D, HIDDEN), (HIDDEN, HIDDEN),
                                                   (2 * INTER, HIDDEN), (HIDDEN, INTER)])
    cache = torch.zeros(2, 1, KV, 768, D, device="cuda", dtype=torch.bfloat16)
    cos = torch.randn(768, D, device="cuda", dtype=torch.bfloat16)
    col, pad = torch.tensor([600], device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
    c = COPIES
    for name, w, inp in [("qkv", qkv, x), ("o", o, x), ("gate_up", gu, x), ("down", down, m_in)]:
        rows.append({"kernel": "gemv", "shape": name, "us": timed(lambda i, w=w, inp=inp: gemv(inp, w[i % c]))})
    norm = (sums[:1], 1e-5)
    for p, bk in [(1, 2048), (2, 1024), (4, 512), (1, 1024)]:
        gf._PAIR_ROWS, gf._BLOCK_K = p, bk
        rows.append({"kernel": "qkv_rope_cache", "rows": 2 * p, "block_k": bk, "us": timed(
            lambda i: gf.qkv_rope_cache(x, qkv[i % c], None, cos, cos, col, pad, cache[0], cache[1], HEADS, norm))})
        rows.append({"kernel": "glu", "rows": 2 * p, "block_k": bk,
                     "us": timed(lambda i: gf.glu(x, gu[i % c], INTER, norm=norm))})
    gf._PAIR_ROWS, gf._BLOCK_K = 1, 2048
    for r, bk in [(2, 2048), (4, 1024), (8, 512), (16, 256)]:
        gf._RESIDUAL_ROWS, gf._BLOCK_K = r, bk
        for name, w, inp in [("o", o, x), ("down", down, m_in)]:
            rows.append({"kernel": "residual", "shape": name, "rows": r, "block_k": bk, "us": timed(
                lambda i, w=w, inp=inp: gf.residual(inp, w[i % c], x, nw, sums[i % c:i % c + 1]))})
    gf._PAIR_ROWS, gf._RESIDUAL_ROWS, gf._BLOCK_K = 1, 4, 1024  # the measured defaults
    adapter_epilogues(rows, x, m_in, nw, sums, gu, down)


def adapter_epilogues(rows: list[dict], x, m_in, nw, sums, gu, down, r: int = 16) -> None:
    """An r=16 adapter's epilogues: the consumer's B t (t summed from partial sums) and the
    producer's partial sums of the next A h, by the number of slots the atomics spread over."""
    c = COPIES
    norm = (sums[:1], 1e-5)
    b_gu = torch.randn(2 * INTER, r, device="cuda", dtype=torch.bfloat16) * 0.01
    b_down = torch.randn(HIDDEN, r, device="cuda", dtype=torch.bfloat16) * 0.01
    a_down = torch.randn(r, INTER, device="cuda", dtype=torch.bfloat16) * 0.01
    a_next = torch.randn(r, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.01
    for slots, ahead in ((1, 1), (4, 4), (16, 16), (64, 64), (4, 16)):  # (read, written) by glu
        t = torch.zeros(2, ahead, r, device="cuda")
        rows.append({"kernel": "glu+adapter", "slots": slots, "slots_ahead": ahead, "us": timed(
            lambda i: gf.glu(x, gu[i % c], INTER, norm=norm, lora=(b_gu, t[0, :slots]), ahead=(a_down, t[1])))})
        if slots != ahead:
            continue
        rows.append({"kernel": "residual+adapter", "shape": "down", "slots": slots, "us": timed(
            lambda i: gf.residual(m_in, down[i % c], x, nw, sums[i % c:i % c + 1], lora=(b_down, t[1]),
                                  ahead=(a_next, t[0])))})


def registers() -> list[dict]:
    """Registers and spills of every compiled variant (Triton's own record)."""
    out = []
    for fn in (_gemv_kernel, gf._qkv_rope_cache_kernel, gf._glu_kernel, gf._residual_kernel,
               da._decode_attention_kernel):
        try:
            for cache in fn.device_caches.values():
                for kernel in cache[0].values():
                    out.append({"kernel": fn.__name__, "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                                "warps": kernel.metadata.num_warps})
        except Exception as exc:  # noqa: BLE001 - Triton internals move between versions
            out.append({"kernel": getattr(fn, "__name__", "?"), "error": repr(exc)[:200]})
    return out


def attention(rows: list[dict]) -> None:
    for batch in (1, 16):
        q = torch.randn(batch, HEADS, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, KV, 768, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        col, pad = torch.tensor([600], device="cuda"), torch.zeros(batch, dtype=torch.long, device="cuda")
        counters = torch.zeros(batch * KV, dtype=torch.int32, device="cuda")
        ref = decode_attention_reference(q, k, v, col, pad, D**-0.5)
        for block_s, target, warps in [(64, 256, 4), (32, 256, 4), (64, 128, 4), (64, 64, 4), (128, 64, 4),
                                       (64, 256, 2), (32, 512, 2)]:
            da._BLOCK_S, da._TARGET_PROGRAMS, da._WARPS = block_s, target, warps
            out = decode_attention(q, k, v, col, pad, D**-0.5, counters=counters)
            err = float((out.float() - ref.float()).abs().max())
            rows.append({"kernel": "decode_attention", "batch": batch, "block_s": block_s, "target": target,
                         "warps": warps, "splits": da.splits_for(batch * KV, 768, 4 * D)[0], "max_err": err,
                         "us": timed(lambda i: decode_attention(q, k, v, col, pad, D**-0.5, counters=counters))})
        da._BLOCK_S, da._TARGET_PROGRAMS, da._WARPS = 64, 256, 4
        rows.append({"kernel": "attention_reference_eager", "batch": batch, "us": timed(
            lambda i: decode_attention_reference(q, k, v, col, pad, D**-0.5))})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rows: list[dict] = []
    products(rows)
    attention(rows)
    regs = registers()
    for r in rows + regs:
        print(json.dumps(r))
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": rows, "registers": regs},
                                   indent=1))


if __name__ == "__main__":
    main()
