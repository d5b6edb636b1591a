"""The QLoRA projections at the 8B shape with the adapter merged into the dequantized weight
(`kestrel.kernels.lora.nf4_lora`) or added separately.

    python bench/lora_merged.py --out lora_merged.json

1. The merged dequantization W + s B A against the plain one, per 8B projection shape (us a
   call, CUDA events, median of 50), at a few row-tile heights.
2. `lora_mlp` over NF4 gate/up/down (4096 -> 14336 -> 4096, r = 16) on 2 x 2048 tokens, merged
   and separate: outputs and every gradient compared, the no-grad forward (a checkpointed
   layer's first pass) and forward + backward (its recompute and backward) timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kestrel.kernels.lora import lora as lora_module  # noqa: E402
from bench.common import cuda_time  # noqa: E402
from kestrel.kernels import nf4
from kestrel.kernels.lora import nf4_lora  # noqa: E402
from kestrel.kernels.lora.lora import LoRAWeights  # noqa: E402
from kestrel.kernels.lora.mlp import lora_mlp  # noqa: E402

H, I, R, M = 4096, 14336, 16, 4096


def _nf4(o: int, i: int) -> tuple[torch.Tensor, object]:
    import bitsandbytes.functional as bnbf

    w = torch.randn(o, i, device="cuda", dtype=torch.bfloat16) / i**0.5
    return bnbf.quantize_4bit(w, compress_statistics=True, quant_type="nf4")


def dequant_times() -> dict:
    out = {}
    for o, i in ((I, H), (H, I), (H, H), (1024, H)):
        packed, state = _nf4(o, i)
        a, b = torch.randn(R, i, device="cuda"), torch.randn(o, R, device="cuda")
        row = {"plain": cuda_time(lambda: nf4.dequantize(packed, state, dtype=torch.bfloat16), iters=50) * 1e6}
        default = nf4_lora._BI
        for bi in (16, 32, 64):
            nf4_lora._BI = bi
            row[f"merged_bi{bi}"] = cuda_time(
                lambda: nf4_lora.dequantize_merged(packed, state, a, b, 2.0, torch.bfloat16), iters=50) * 1e6
        nf4_lora._BI = default
        row["bytes_per_us_plain"] = (packed.numel() + o * i * 2) / row["plain"] / 1e6
        out[f"{o}x{i}"] = row
        print(f"{o}x{i}", json.dumps(row), flush=True)
    return out


def _grads(ws: list[LoRAWeights], x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    params = [x, *(t for w in ws for t in (w.lora_A, w.lora_B))]
    y = lora_mlp(x, *ws)
    return [y, *torch.autograd.grad(y, params, dy)]


def mlp_times() -> dict:
    torch.manual_seed(0)
    ws = []
    for i, o in ((H, I), (H, I), (I, H)):
        packed, state = _nf4(o, i)
        a = (torch.randn(R, i, device="cuda") / i**0.5).requires_grad_()
        b = (torch.randn(o, R, device="cuda") * 0.02).requires_grad_()
        ws.append(LoRAWeights(packed, state, a, b, 2.0))
    x = torch.randn(2, M // 2, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(2, M // 2, H, device="cuda", dtype=torch.bfloat16)
    real = lora_module._merges
    results, reference = {}, None
    for mode in ("separate", "merged", "separate", "merged"):
        lora_module._merges = real if mode == "merged" else (lambda ws: False)
        got = _grads(ws, x, dy)
        reference = reference or got
        err = max(((g - r).float().abs().max() / r.float().abs().max()).item() for g, r in zip(got, reference))

        def forward() -> None:
            with torch.no_grad():
                lora_mlp(x, *ws)

        row = {"max_rel_err_vs_separate": err, "forward_ms": cuda_time(forward, iters=20) * 1e3,
               "forward_backward_ms": cuda_time(lambda: _grads(ws, x, dy), iters=20) * 1e3}
        results.setdefault(mode, []).append(row)
        print(mode, json.dumps(row), flush=True)
    lora_module._merges = real
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "dequant_us": dequant_times(), "mlp": mlp_times()}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
