"""One layer's causal attention at a model's shape, as a checkpointed layer runs it, two ways:

- `recomputed`: SDPA's forward in the first pass (no grad), then forward and backward again in the
  recompute (what every layer does without `performance.keep_attention`);
- `kept`: cuDNN's forward with its logsumexp in the first pass, then only the backward
  (`kestrel.model.kept_attention.KeptAttention`), from the kept output and logsumexp.

Each is first checked against SDPA with autograd (relative error of the output and of q's, k's and v's
gradients), then timed (median of CUDA-event timings). What `kept` saves is the recompute's forward;
the host copies of the kept pair are not in it (they run on a side stream beside the next layers).

    python bench/kept_attention.py --shape qwen3-4b --seq 8192 --out kept_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cuda_time  # noqa: E402
from bench.model_shapes import MODELS  # noqa: E402
from kestrel.model.kept_attention import CausalKernels, CUDNN_CAUSAL, kept_attention  # noqa: E402


def heads(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a model config."""
    hq = cfg["num_attention_heads"]
    return hq, cfg.get("num_key_value_heads", hq), cfg.get("head_dim") or cfg["hidden_size"] // hq


def inputs(batch: int, seq: int, hq: int, hkv: int, d: int, device: str = "cuda",
           dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """q, k, v as the model lays them out ((B, S, H, D) seen as (B, H, S, D)) and an output gradient."""
    gen = torch.Generator(device=device).manual_seed(0)
    make = lambda h: torch.randn(batch, seq, h, d, device=device, dtype=dtype, generator=gen).transpose(1, 2)  # noqa: E731
    return [make(hq), make(hkv), make(hkv), make(hq)]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, scale: float,
           kernels: CausalKernels = CUDNN_CAUSAL) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """name -> a checkpointed layer's attention work, both passes; returns (out, dq, dk, dv)."""

    def recomputed() -> list[torch.Tensor]:
        with torch.no_grad():
            _sdpa(q, k, v, scale)  # the first pass
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = _sdpa(*leaves, scale)  # the recompute
        out.backward(grad)
        return [out.detach(), *(t.grad for t in leaves)]

    def kept() -> list[torch.Tensor]:
        with torch.no_grad():
            pair = kernels.forward(q, k, v, scale)  # the first pass, its logsumexp kept
        pair = (pair[0].contiguous(), pair[1].contiguous())  # as it comes back from host memory
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = kept_attention(*leaves, pair, scale, kernels)
        out.backward(grad)
        return [out.detach(), *(t.grad for t in leaves)]

    return {"recomputed": recomputed, "kept": kept}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-4b", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    hq, hkv, d = heads(MODELS[args.shape])
    q, k, v, grad = inputs(args.batch, args.seq, hq, hkv, d)
    scale = d ** -0.5
    ways = passes(q, k, v, grad, scale)
    want = ways["recomputed"]()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shape": args.shape, "batch": args.batch,
                              "seq": args.seq, "heads": [hq, hkv, d], "ways": {}}
    for name, fn in ways.items():
        got = fn()
        errors = {n: relative_error(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
        report["ways"][name] = {"ms": 1e3 * cuda_time(fn), "relative_error": errors}
        print(name, report["ways"][name], flush=True)
    ms = {n: w["ms"] for n, w in report["ways"].items()}
    report["kept_over_recomputed"] = ms["kept"] / ms["recomputed"]
    print(f"kept / recomputed: {report['kept_over_recomputed']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
