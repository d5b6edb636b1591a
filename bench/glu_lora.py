"""The LoRA MLP's backward through the GLU at the 8B shape: the fused kernel (`kernels.glu_lora`,
one pass over E, G, dh) against the unfused sequence it replaces (the GLU kernel plus five rank-r
products), and a sweep of the fused kernel's tiles.

    python bench/glu_lora.py --out glu_lora.json

Both start from dY (M, H), the dequantized W_d and the saved rank-r pieces; E and G are restored
before each call (both write over them). Times: median of CUDA-event timings, us a call.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import cuda_time  # noqa: E402
from kernels import glu, glu_lora  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    m, h, i, r = args.tokens, args.hidden, args.inter, args.rank
    bf = dict(device="cuda", dtype=torch.bfloat16)
    e0, g0 = torch.randn(m, i, **bf), torch.randn(m, i, **bf)
    e, g = e0.clone(), g0.clone()
    dy, w_d = torch.randn(m, h, **bf) * 0.1, torch.randn(h, i, **bf) * 0.02
    p, xg, xu = (torch.randn(m, r, **bf) for _ in range(3))
    a_d, b_g, b_u = torch.randn(r, i, **bf), torch.randn(i, r, **bf), torch.randn(i, r, **bf)
    hkeep = torch.randn(m, i, **bf)

    def unfused() -> None:
        e.copy_(e0), g.copy_(g0)
        dh = torch.mm(p, a_d).addmm_(dy, w_d)
        torch.mm(p.t(), hkeep)  # dA_d (h kept from the recompute)
        de, dg = glu.glu_backward(dh, e, g, gelu=False, inplace=True)
        torch.cat([torch.mm(de, b_g), torch.mm(dg, b_u)], 1)
        torch.mm(de.t(), xg), torch.mm(dg.t(), xu)

    def fused() -> None:
        e.copy_(e0), g.copy_(g0)
        glu_lora.glu_lora_backward(e, g, torch.mm(dy, w_d), p, a_d, b_g, b_u, xg, xu, gelu=False)

    def restore() -> None:
        e.copy_(e0), g.copy_(g0)

    base = cuda_time(restore, warmup=3, iters=20)
    results = {"shape": [m, h, i, r], "restore_us": base * 1e6, "unfused_us": (cuda_time(unfused, 3, 20) - base) * 1e6}
    sweep = {}
    for bm, bn, warps, groups in itertools.product((64, 128), (32, 64, 128), (4, 8), (4, 8, 16)):
        if bm * bn > 8192:
            continue
        glu_lora._BM, glu_lora._BN, glu_lora._WARPS, glu_lora._GROUPS = bm, bn, warps, groups
        try:
            sweep[f"{bm}x{bn} w{warps} g{groups}"] = (cuda_time(fused, 3, 20) - base) * 1e6
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
            sweep[f"{bm}x{bn} w{warps} g{groups}"] = repr(exc)[:120]
    results["fused_us"] = sweep
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
