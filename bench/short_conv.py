"""A Qwen3.5 linear-attention layer's short causal convolution (depthwise, width w, then SiLU),
forward plus backward at a model's shape, on one GPU, three ways:

- `hf`: HF's `causal_conv1d_fn` (F.conv1d on (B, C, T), so a transposed copy each way);
- `fla`: flash-linear-attention's Triton kernel on (B, T, C), one sample a row (it resets only at
  `cu_seqlens`, which needs the host, so a CUDA graph cannot hold it);
- `kestrel_kernel`: `kestrel.kernels.short_conv`'s Triton kernels, each packed sample on its own,
  and `kestrel_kernel_one_sample` the same with one sample a row (what training passes take);
- `kestrel_torch`: its PyTorch reference (w shifted products in fp32, masked at each sample's
  start), what the kernels replace.

Each is first checked against HF's function run on each sample alone (relative error of the
output and of x's gradient), then timed (median of CUDA-event timings).

    python bench/short_conv.py --shape qwen3.5-9b --batch 1 --seq 4096 --out conv.json
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cuda_time  # noqa: E402
from kestrel.kernels.gated_delta import relative_errors  # noqa: E402
from bench.gated_delta import linear_attention_shapes, shape_arguments  # noqa: E402


def channels(cfg: dict[str, Any]) -> tuple[int, int]:
    """(C, w): the convolution's channels (q, k and v side by side) and width."""
    c = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    return c + cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]


def sample_offsets(batch: int, seq: int, seed: int = 0, low: int = 64, high: int = 1024) -> torch.Tensor:
    """(B, T) offsets of packed samples of random lengths in [low, high]."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        parts, used = [], 0
        while used < seq:
            n = min(int(torch.randint(low, high + 1, (1,), generator=gen)), seq - used)
            parts.append(torch.arange(n))
            used += n
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def ways(offsets: torch.Tensor) -> dict[str, Callable[..., torch.Tensor]]:
    """name -> fn(x (B, T, C), weight (C, w), bias) -> (B, T, C)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from kestrel.kernels.short_conv import _ShortConv, short_conv_reference
    hf = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)
    out: dict[str, Callable[..., torch.Tensor]] = {
        "hf": lambda x, w, b: hf(x.transpose(1, 2), w, b, activation="silu").transpose(1, 2),
        "kestrel_torch": lambda x, w, b: short_conv_reference(x, w, b, "silu", offsets),
    }
    if offsets.is_cuda:
        out["kestrel_kernel"] = lambda x, w, b: _ShortConv.apply(x, w, b, offsets, True)
        out["kestrel_kernel_one_sample"] = lambda x, w, b: _ShortConv.apply(x, w, b, None, True)
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return out
    out["fla"] = lambda x, w, b: causal_conv1d(x=x, weight=w, bias=b, activation="silu", backend="triton")[0]
    return out


def per_sample_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                         offsets: torch.Tensor) -> torch.Tensor:
    """HF's function on each packed sample alone, in fp32, laid out as packed."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    hf = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)
    out = torch.empty_like(x)
    for row in range(x.shape[0]):
        starts = (offsets[row] == 0).nonzero().flatten().tolist() + [x.shape[1]]
        for a, z in zip(starts, starts[1:]):
            part = x[row : row + 1, a:z].transpose(1, 2)
            out[row : row + 1, a:z] = hf(part, w, b, activation="silu").transpose(1, 2)
    return out


def run(shape: str, batch: int, seq: int, dtype: torch.dtype) -> dict[str, Any]:
    c, width = channels(linear_attention_shapes()[shape])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, c, generator=gen).cuda()
    w, b = (torch.randn(c, width, generator=gen) * 0.5).cuda(), torch.randn(c, generator=gen).cuda() * 0.1
    grad = torch.randn(batch, seq, c, generator=gen).cuda()
    offsets = sample_offsets(batch, seq).cuda()
    xr = x.clone().requires_grad_()
    want = per_sample_reference(xr, w, b, offsets)
    (want_dx,) = torch.autograd.grad(want, xr, grad)
    packed_ref = {"y": want.detach(), "dx": want_dx}
    xr = x.clone().requires_grad_()
    whole = ways(offsets)["hf"](xr, w, b)
    alone_ref = {"y": whole.detach(), "dx": torch.autograd.grad(whole, xr, grad)[0]}
    record: dict[str, Any] = {"shape": shape, "batch": batch, "seq": seq, "channels": c, "width": width,
                              "dtype": str(dtype), "samples": int((offsets == 0).sum()),
                              "device": torch.cuda.get_device_name(), "ways": {}}
    for name, fn in ways(offsets).items():
        xs = x.to(dtype).requires_grad_()
        ws, bs = w.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
        y = fn(xs, ws, bs)
        (dx,) = torch.autograd.grad(y, xs, grad.to(dtype))
        ref = packed_ref if name in ("kestrel_torch", "kestrel_kernel") else alone_ref  # the others: a row, one sample
        errors = dict(zip(("y", "dx"), relative_errors([y.float(), dx.float()], [ref["y"], ref["dx"]])))

        def step(fn=fn, xs=xs, ws=ws, bs=bs) -> None:
            out = fn(xs, ws, bs)
            torch.autograd.grad(out, (xs, ws, bs), grad.to(dtype))

        record["ways"][name] = {"ms": cuda_time(step, warmup=5, iters=30) * 1e3, "errors": errors}
        print(name, record["ways"][name], flush=True)
    return record


def main() -> None:
    args = shape_arguments(__doc__)
    record = run(args.shape, args.batch, args.seq, torch.bfloat16)
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
