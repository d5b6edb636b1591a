"""The QLoRA MLP at the 8B shape, with the adapter added separately or folded into the products.

    python bench/lora_ext.py --out lora_ext.json

`lora_mlp` over NF4 gate/up/down (4096 -> 14336 -> 4096, r = 16) on 2 x 2048 tokens, for each
`KESTREL_LORA_EXT` mode (off: adapter added separately; shared: folded, W_ext in the NF4
workspace; own: folded, W_ext in its own buffer, reused from recompute to backward):
- checks outputs and every gradient against mode off (relative to each tensor's largest value);
- times the no-grad forward (a checkpointed layer's first pass) and forward + backward (its
  recompute and backward), CUDA events, median of 20;
- records the NF4 workspace's size.
Then times `copy_shrink` at a few tile shapes against a copy plus a shrink product.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import cuda_time  # noqa: E402
from kernels import lora_ext, nf4  # noqa: E402
from kernels.lora import LoRAWeights, lora_mlp  # noqa: E402

H, I, R, M = 4096, 14336, 16, 4096


def _weights() -> list[LoRAWeights]:
    import bitsandbytes.functional as bnbf

    out = []
    for i, o in ((H, I), (H, I), (I, H)):
        w = torch.randn(o, i, device="cuda", dtype=torch.bfloat16) / i**0.5
        packed, state = bnbf.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
        a = (torch.randn(R, i, device="cuda") / i**0.5).requires_grad_()
        b = (torch.randn(o, R, device="cuda") * 0.02).requires_grad_()
        out.append(LoRAWeights(packed, state, a, b, 2.0))
    return out


def _grads(ws: list[LoRAWeights], x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    params = [x, *(t for w in ws for t in (w.lora_A, w.lora_B))]
    y = lora_mlp(x, *ws)
    return [y, *torch.autograd.grad(y, params, dy)]


def mlp_modes() -> dict:
    torch.manual_seed(0)
    ws = _weights()
    x = torch.randn(2, M // 2, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(2, M // 2, H, device="cuda", dtype=torch.bfloat16)
    results, reference = {}, None
    for mode in ("off", "shared", "own", "off", "shared", "own"):
        os.environ["KESTREL_LORA_EXT"] = mode
        nf4.WORKSPACE.clear()
        lora_ext.forget()
        got = _grads(ws, x, dy)
        reference = reference or got
        err = max(((g - r).float().abs().max() / r.float().abs().max()).item() for g, r in zip(got, reference))

        def forward() -> None:
            with torch.no_grad():
                lora_mlp(x, *ws)

        row = {
            "max_rel_err_vs_off": err,
            "forward_ms": cuda_time(forward, iters=20) * 1e3,
            "forward_backward_ms": cuda_time(lambda: _grads(ws, x, dy), iters=20) * 1e3,
            "workspace_mib": sum(b.numel() * b.element_size() for b in nf4.WORKSPACE._buffers.values()) / 2**20,
        }
        results.setdefault(mode, []).append(row)
        print(mode, json.dumps(row), flush=True)
    return results


def copy_shrink_tiles() -> dict:
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(2 * R, H, device="cuda", dtype=torch.bfloat16)
    out = {}

    def separate() -> None:
        ext = torch.empty(M, H + 2 * R, device="cuda", dtype=torch.bfloat16)
        ext[:, :H].copy_(x)
        torch.mm(x, a.t(), out=ext[:, H:])

    out["copy_then_mm"] = cuda_time(separate, iters=50) * 1e6
    default = (lora_ext._BM, lora_ext._BK)
    for bm in (16, 32, 64):
        for bk in (64, 128, 256):
            lora_ext._BM, lora_ext._BK = bm, bk
            out[f"bm{bm}_bk{bk}"] = cuda_time(lambda: lora_ext.copy_shrink(x, a, [R, R], [2.0, 2.0]), iters=50) * 1e6
    lora_ext._BM, lora_ext._BK = default
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "copy_shrink_us": copy_shrink_tiles(), "mlp": mlp_modes()}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
