"""The GLU passes with the LoRA MLP's rank-r products folded in (`kernels.glu_lora`) against the
separate passes they replace, and a tile sweep of both kernels, at the Llama-3.1-8B MLP
(4,096 tokens x 14,336, r = 16, bf16) on one CUDA GPU.

    python bench/glu_lora.py --out glu_lora.json

Kernel time only (`triton.testing.do_bench`). The in-place backward runs on the same buffers
each time: that changes the values, not the work. Before timing, every fused result is checked
against the separate passes on the same inputs (`check`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from kernels import glu, glu_lora  # noqa: E402

M, I, R = 4096, 14336, 16


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100) * 1e3  # us


def _inputs() -> dict[str, torch.Tensor]:
    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda")).to(torch.bfloat16)

    return {"e": r(M, I), "g": r(M, I), "dh": r(M, I, scale=0.01), "a": r(R, I, scale=I**-0.5),
            "xa": r(M, 2 * R), "dyb": r(M, R, scale=0.01)}


def separate(t: dict) -> dict[str, float]:
    """The passes the fused kernels replace (h kept from the recompute, as before)."""
    e, g = t["e"], t["g"]
    h = glu.glu_forward(e, g, gelu=False)
    fwd = _time(lambda: torch.mm(glu.glu_forward(e, g, gelu=False), t["a"].t()).mul_(2.0))

    def bwd() -> None:
        torch.mm(t["dyb"].t(), h)
        de, dg = glu.glu_backward(t["dh"], e, g, gelu=False, inplace=True)
        torch.mm(de.t(), t["xa"][:, :R])
        torch.mm(dg.t(), t["xa"][:, R:])

    return {"forward_us": fwd, "backward_us": _time(bwd)}


def fused(t: dict) -> dict[str, float]:
    e, g = t["e"], t["g"]
    fwd = _time(lambda: glu_lora.glu_shrink(e, g, t["a"], 2.0, "swiglu"))
    bwd = _time(lambda: glu_lora.glu_lora_backward(t["dh"], e, g, t["xa"], R, t["dyb"], "swiglu"))
    return {"forward_us": fwd, "backward_us": bwd}


def check(t: dict) -> dict[str, float]:
    """Relative max error of the fused results against the separate passes on the same inputs."""
    e, g = t["e"].clone(), t["g"].clone()
    h = glu.glu_forward(e, g, gelu=False)
    want_fwd = (h.float() @ t["a"].float().t() * 2.0)
    got_fwd = glu_lora.glu_shrink(e, g, t["a"], 2.0, "swiglu").float()
    e2, g2 = e.clone(), g.clone()
    de, dg = glu.glu_backward(t["dh"], e, g, gelu=False, inplace=True)
    want = [de.float().t() @ t["xa"][:, :R].float(), dg.float().t() @ t["xa"][:, R:].float(),
            t["dyb"].float().t() @ h.float()]
    fde, fdg, *got = glu_lora.glu_lora_backward(t["dh"], e2, g2, t["xa"], R, t["dyb"], "swiglu")

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    return {"shrink": rel(got_fwd, want_fwd), "de_equal": bool(torch.equal(fde, de)),
            "dg_equal": bool(torch.equal(fdg, dg)), **{k: rel(x, y) for k, x, y in zip(("db_g", "db_u", "da_d"), got, want)}}


def sweep(t: dict) -> dict[str, dict]:
    out = {}
    for bm, bi, w, st in ((64, 64, 4, 2), (64, 64, 4, 4), (128, 64, 8, 3), (64, 128, 4, 3)):
        glu_lora._SHRINK_BM, glu_lora._SHRINK_BI, glu_lora._SHRINK_WARPS, glu_lora._STAGES = bm, bi, w, st
        glu_lora._shrink_plan.cache_clear()
        out[f"shrink_bm{bm}_bi{bi}_w{w}_s{st}"] = _time(
            lambda: glu_lora.glu_shrink(t["e"], t["g"], t["a"], 2.0, "swiglu"))
    for tr in (False,):
        for bm, bi, w, st in ((32, 64, 4, 3), (32, 64, 4, 4), (32, 64, 8, 3), (64, 64, 4, 3), (32, 128, 4, 3),
                              (16, 64, 4, 4), (32, 32, 4, 4), (64, 32, 4, 3)):
            glu_lora._BWD_BM, glu_lora._BWD_BI, glu_lora._BWD_WARPS = bm, bi, w
            glu_lora._BWD_STAGES, glu_lora._BWD_TRANSPOSED = st, tr
            glu_lora._bwd_plan.cache_clear()
            key = f"backward_{'T' if tr else 'N'}_bm{bm}_bi{bi}_w{w}_s{st}"
            try:
                out[key] = _time(lambda: glu_lora.glu_lora_backward(
                    t["dh"], t["e"], t["g"], t["xa"], R, t["dyb"], "swiglu"))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile
                print(key, type(exc).__name__, str(exc)[:200])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="glu_lora.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    t = _inputs()
    result = {"device": torch.cuda.get_device_name(), "check": check(_inputs()),
              "separate": separate(t), "fused": fused(t)}
    print(json.dumps(result, indent=1), flush=True)
    result["sweep"] = sweep(t)
    for k, v in sorted(result["sweep"].items(), key=lambda kv: kv[1]):
        print(f"{k:32} {v:8.1f} us")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
