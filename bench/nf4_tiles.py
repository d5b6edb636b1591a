"""Tile sweep for the NF4 dequantization kernels, plain and with the LoRA update merged in.

    python bench/nf4_tiles.py --out nf4_tiles.json

Kernel time only (`triton.testing.do_bench_cudagraph`: launches replayed from a CUDA graph, so
host launch cost does not enter), at the Llama-3.1-8B projection shapes, bf16 output, nested
absmax, r = 16 adapters in fp32 (PEFT's dtype). Every merged variant's output is checked against
fp64 math: `err/bound` must stay below 1 (bound: bf16 rounding of W' plus bf16-operand products).

Variants of the merged kernel:
- `tiled`: kestrel.kernels.nf4_lora's kernel (bytes decoded as (BI, BJ/2) pairs, joined, reshaped to
  (BI, NB, 64) for the block scales), the rank-r tl.dot on fp32 operands or on bf16 ones. (The
  session-7 sweep in bench/RESULTS.md also had TF32 operands, 3-5% behind bf16; the kernel kept
  bf16 for 16-bit outputs and exact fp32 for fp32 ones.)
- `flat`: each output element decodes its own nibble (byte j // 2, high or low by parity) and
  gathers its block scale, with no join or reshape, so the values can be formed in whatever
  layout the tl.dot result has.
Also the plain kernel (kestrel.kernels.nf4) over quant-blocks-per-program and warps, and bitsandbytes.
`--quick`: the two MLP shapes and the tiled bf16 configs only, each with the adapter given in
fp32 (as PEFT holds it) and in bf16 (as `kestrel.kernels.lora.casts` keeps it cast once a step).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kestrel.kernels import nf4
from kestrel.kernels.lora import nf4_lora  # noqa: E402
from kestrel.kernels._launch import launch  # noqa: E402
from kestrel.kernels.nf4 import block_scales  # noqa: E402

R = 16
SHAPES = ((14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096))


@triton.jit
def _flat_kernel(
    w_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, a_ptr, b_ptr, out_ptr,
    n_rows, scaling, R,
    IN: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
    BI: tl.constexpr, BJ: tl.constexpr, RP: tl.constexpr, BF16_DOT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BI + tl.arange(0, BI)
    cols = tl.program_id(1) * BJ + tl.arange(0, BJ)
    row_ok = rows < n_rows
    ranks = tl.arange(0, RP)
    rank_ok = ranks < R
    b = tl.load(b_ptr + rows[:, None] * R + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
    a = tl.load(a_ptr + ranks[:, None] * IN + cols[None, :], mask=rank_ok[:, None], other=0.0)
    if BF16_DOT:
        delta = tl.dot(b.to(tl.bfloat16), a.to(tl.bfloat16))
    else:
        delta = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    flat = rows[:, None] * IN + cols[None, :]  # (BI, BJ)
    mask = row_ok[:, None]
    packed = tl.load(w_ptr + flat // 2, mask=mask, other=0)
    nib = tl.where((cols % 2 == 0)[None, :], packed >> 4, packed & 15)
    scale = block_scales(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, flat // BLOCKSIZE, mask, BLOCKSIZE2, NESTED)
    vals = tl.load(code_ptr + nib.to(tl.int32)) * scale + scaling * delta
    tl.store(out_ptr + flat, vals.to(out_ptr.dtype.element_ty), mask=mask)


def _weights(o: int, i: int) -> tuple:
    import bitsandbytes.functional as bnbf

    w = torch.randn(o, i, device="cuda", dtype=torch.bfloat16) / i**0.5
    packed, state = bnbf.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
    a = torch.randn(R, i, device="cuda") / i**0.5
    b = torch.randn(o, R, device="cuda") * 0.05
    return packed, state, a, b


def _check(out: torch.Tensor, packed, state, a, b, s: float) -> float:
    """max err/bound against fp64 W + s B A (bound: bf16 rounding plus bf16-operand products)."""
    dense = nf4.dequantize_reference(packed, state, torch.float32).double()
    exact = dense + s * (b.double() @ a.double())
    bound = 2.0**-8 * exact.abs() + 2 * 2.0**-8 * s * (b.double().abs() @ a.double().abs()) + 1e-30
    return float(((out.double() - exact).abs() / bound).max())


def _time(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3  # us


def sweep_merged(o: int, i: int, configs: list[tuple] | None = None, ab16: bool = False) -> dict:
    """us and err/bound per (kernel, dot operands, BI, BJ, warps); `configs` limits the sweep;
    ab16: the adapter's A and B handed to the kernel in bf16."""
    packed, state, a, b = _weights(o, i)
    if ab16:
        a, b = a.bfloat16(), b.bfloat16()
    plan, s = nf4._plan(packed, state), 2.0
    out = torch.empty(o, i, device="cuda", dtype=torch.bfloat16)
    row = {}
    for name, bf16, bi, bj, nw in configs or list(_all_configs()):
        key = f"{name}_{'bf16' if bf16 else 'fp32'}_bi{bi}_bj{bj}_w{nw}"
        # the product kernel takes (OPERANDS16, DOT16), the flat one BF16_DOT
        kernel, flags = (nf4_lora._nf4_lora_kernel, (bf16, bf16)) if name == "tiled" else (_flat_kernel, (bf16,))

        def run() -> None:
            launch(kernel, (triton.cdiv(o, bi), i // bj), *plan.tensors, a, b, out, o, s, R,
                   i, plan.blocksize, plan.blocksize2, plan.nested, bi, bj, 16, *flags,
                   num_warps=nw, enable_fp_fusion=False)

        try:
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            row[key] = {"us": _time(run), "err/bound": _check(out, packed, state, a, b, s),
                        "config": [name, bf16, bi, bj, nw]}
        except Exception as exc:  # noqa: BLE001 - a config that does not compile
            row[key] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
    row["current"] = {"us": _time(lambda: nf4_lora.dequantize_merged(packed, state, a, b, s, torch.bfloat16))}
    return row


def _all_configs():
    for name in ("tiled", "flat"):
        for bf16 in (False, True):
            for bi in (32, 64, 128):
                for bj in (128, 256):
                    for nw in (4, 8):
                        yield name, bf16, bi, bj, nw


def sweep_plain(o: int, i: int) -> dict:
    import bitsandbytes.functional as bnbf

    packed, state, _, _ = _weights(o, i)
    plan = nf4._plan(packed, state)
    out = torch.empty(o, i, device="cuda", dtype=torch.bfloat16)
    truth = nf4.dequantize_reference(packed, state, torch.bfloat16)
    row = {"bitsandbytes": {"us": _time(lambda: bnbf.dequantize_4bit(packed, state, out=out))}}
    for rows in (16, 32, 64, 128):
        for nw in (2, 4, 8):
            def run() -> None:
                launch(nf4._nf4_dequant_kernel, (triton.cdiv(plan.n_blocks, rows),), *plan.tensors, out, plan.n,
                       plan.n_blocks, plan.blocksize, plan.blocksize2, plan.nested, rows,
                       num_warps=nw, enable_fp_fusion=False)

            out.fill_(float("nan"))
            run()
            row[f"rows{rows}_w{nw}"] = {"us": _time(run), "exact": bool(torch.equal(out, truth))}
    moved = packed.numel() + o * i * 2
    for v in row.values():
        v["TB/s"] = moved / v["us"] / 1e6
    return row


def quick() -> dict:
    configs = [("tiled", True, bi, bj, nw) for bi in (32, 64) for bj in (128, 256) for nw in (4, 8)]
    result = {}
    for o, i in SHAPES[:2]:
        for ab16 in (False, True):
            row = sweep_merged(o, i, configs, ab16)
            result[f"{o}x{i}_ab{'16' if ab16 else '32'}"] = row
            ok = sorted((v["us"], k, round(v["err/bound"], 3)) for k, v in row.items() if "err/bound" in v)
            print(f"merged {o}x{i} adapter {'bf16' if ab16 else 'fp32'}: current {row['current']['us']:.1f} us, "
                  f"best {ok[:4]}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="nf4_tiles.json")
    parser.add_argument("--quick", action="store_true", help="MLP shapes, tiled bf16 configs, fp32/bf16 adapter")
    args = parser.parse_args()
    if args.quick:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "quick": quick()}, indent=1))
        return
    result = {"device": torch.cuda.get_device_name(), "plain": {}, "merged": {}}
    top = None  # the full merged sweep on the first shape, its best 6 configs on the others
    for o, i in SHAPES:
        result["plain"][f"{o}x{i}"] = plain = sweep_plain(o, i)
        best = sorted((v["us"], k) for k, v in plain.items())[:4]
        print(f"plain {o}x{i}: bnb {plain['bitsandbytes']['us']:.1f} us, rows32_w4 {plain['rows32_w4']['us']:.1f}, "
              f"best {[(k, round(t, 1)) for t, k in best]}", flush=True)
        result["merged"][f"{o}x{i}"] = merged = sweep_merged(o, i, top)
        if top is None:
            ranked = sorted((v["us"], k) for k, v in merged.items() if v.get("err/bound", 2) <= 1)
            top = [tuple(merged[k]["config"]) for _, k in ranked[:6]]
        ok = sorted((v["us"], k, round(v["err/bound"], 3)) for k, v in merged.items() if "err/bound" in v)
        print(f"merged {o}x{i}: current {merged['current']['us']:.1f} us, best {ok[:6]}", flush=True)
        bad = [k for k, v in merged.items() if v.get("err/bound", 0) > 1 or "error" in v]
        if bad:
            print(f"  failing or erroring: {bad[:8]}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
