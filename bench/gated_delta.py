"""One gated-delta-rule op (a Qwen3.5 linear-attention layer's core, q/k normalised in it), forward
plus backward at a model's shape, on one GPU: Kestrel's stand-in (`kestrel.kernels.gated_delta`:
flash-linear-attention's stages, the one it refuses on Hopper under Triton 3.4-3.7.0 done each of the
stand-in's ways: its kernel on a clean tile, PyTorch), flash-linear-attention's own function (where its backward runs) and
HF's PyTorch function (what trains where neither runs). Each is checked against HF's function in
fp32 first (relative error of output and gradients), then timed (median of CUDA-event timings).

    python bench/gated_delta.py --shape qwen3.5-9b --batch 1 --seq 4096 --out gated.json
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cuda_time  # noqa: E402
from bench.model_shapes import MODELS, MOE_MODELS  # noqa: E402


def linear_attention_shapes() -> dict[str, dict[str, Any]]:
    """The bench's model shapes with gated-delta-rule layers (Qwen3.5, dense and MoE)."""
    return {name: cfg for name, cfg in {**MODELS, **MOE_MODELS}.items() if "linear_num_value_heads" in cfg}


def inputs(cfg: dict[str, Any], batch: int, seq: int, device: str = "cuda") -> list[torch.Tensor]:
    """q, k (value heads wide, as the layer repeats them), v, g, beta and the output's gradient."""
    heads, dk, dv = cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    q, k, v = rnd(batch, seq, heads, dk), rnd(batch, seq, heads, dk), rnd(batch, seq, heads, dv)
    return [q, k, v, -F.softplus(rnd(batch, seq, heads)), rnd(batch, seq, heads).sigmoid(), rnd(batch, seq, heads, dv)]


def shape_arguments(doc: str | None) -> argparse.Namespace:
    """The command line of a bench that times one linear-attention layer part: --shape (a model
    with gated-delta-rule layers), --batch, --seq and --out."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.5-9b", choices=sorted(linear_attention_shapes()))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def main() -> None:
    args = shape_arguments(__doc__)

    from transformers.models.qwen3_5 import modeling_qwen3_5

    from kestrel.kernels import gated_delta
    from kestrel.model.linear_attention import _fla_ops, fla_backward_works

    # HF wraps its PyTorch function so that flash-linear-attention's kernel runs when installed
    reference = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    xs = inputs(linear_attention_shapes()[args.shape], args.batch, args.seq)
    ways: dict[str, Callable[..., Any]] = {"hf_reference": reference}
    ops = _fla_ops()
    if ops is not None and gated_delta.available():
        for way in gated_delta.DQKWG:  # the refused stage on fla's kernel (a clean tile), and in PyTorch
            ways[f"kestrel_{way}_way"] = functools.partial(gated_delta.chunk_gated_delta_rule, dqkwg=way)
        if fla_backward_works(torch.device("cuda"), ops[0]):
            ways["fla"] = ops[0]
    q, k, v, g, beta, grad = xs
    want = gated_delta.forward_backward(reference, q, k, v, g, beta, grad, torch.float32)
    result: dict[str, Any] = {"shape": args.shape, "batch": args.batch, "seq": args.seq,
                              "device": torch.cuda.get_device_name(), "triton": __import__("triton").__version__}
    for name, fn in ways.items():
        # bf16 inputs, as training passes them (HF's function widens them)
        got = gated_delta.forward_backward(fn, q, k, v, g, beta, grad, torch.bfloat16)
        errors = dict(zip(gated_delta.OUTPUTS, gated_delta.relative_errors(got, want)))
        torch.cuda.reset_peak_memory_stats()
        seconds = cuda_time(lambda: gated_delta.forward_backward(fn, q, k, v, g, beta, grad, torch.bfloat16),
                            warmup=2, iters=5 if name == "hf_reference" else 15)
        result[name] = {"fwd_bwd_ms": seconds * 1e3, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                        "relative_error": errors}
        print(name, json.dumps(result[name]), flush=True)
    for way in gated_delta.DQKWG:
        if f"kestrel_{way}_way" in result:
            result[f"{way}_way_vs_reference"] = (result["hf_reference"]["fwd_bwd_ms"]
                                                 / result[f"kestrel_{way}_way"]["fwd_bwd_ms"])
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
