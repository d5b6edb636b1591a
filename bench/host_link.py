"""The GPU's host link while the GPU computes: what offloading activations can count on.

    python bench/host_link.py --out host_link.json

Measures, with page-locked host buffers of one Llama-8B MLP intermediate (2 x 2048 x 14336 bf16,
117 MB):
- copy bandwidth to and from the host alone (GB/s);
- a loop of the 8B MLP's gate product (4096 x 4096 @ 4096 x 14336, bf16) alone, and again while a
  side stream copies buffers out (then in, then both ways) the whole time: the product's time
  (does the copy slow the power-capped GPU?) and the copies' bandwidth under that load;
- a pure-Python loop (dict and list work, like a training step's host side) on an idle link and
  while copies run out, in, or both: does the host slow down while the GPU writes its memory?
"""

from __future__ import annotations

import argparse
import json
import time

import torch

MB = 2**20


def _copy_rate(dst: list[torch.Tensor], src: list[torch.Tensor], stream: torch.cuda.Stream) -> float:
    """GB/s of copying each src into its dst on `stream`, timed with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return sum(s.numel() * s.element_size() for s in src) / (start.elapsed_time(end) * 1e-3) / 1e9


def _products(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, n: int) -> float:
    """ms per product over n back-to-back products on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        torch.mm(x, w, out=out)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def _python_loop_ms() -> float:
    """A fixed amount of interpreter work (dicts, small lists, string formatting), in ms."""
    t0, d = time.perf_counter(), {}
    for i in range(300_000):
        d[i % 1000] = (i, str(i))
        _ = [j for j in range(5)]
    return (time.perf_counter() - t0) * 1e3


def _python_under_copies(dev: list[torch.Tensor], host: list[torch.Tensor]) -> dict[str, float]:
    """`_python_loop_ms` with the link idle and while ~0.3 s of copies run each way (own streams)."""
    out_stream, in_stream = torch.cuda.Stream(), torch.cuda.Stream()
    res = {}
    for mode in ("idle", "out", "in", "both", "idle_after"):
        for _ in range(10):
            for d, h in zip(dev, host):
                if mode in ("out", "both"):
                    with torch.cuda.stream(out_stream):
                        h.copy_(d, non_blocking=True)
                if mode in ("in", "both"):
                    with torch.cuda.stream(in_stream):
                        d.copy_(h, non_blocking=True)
        res[f"python_loop_ms_{mode}"] = _python_loop_ms()
        torch.cuda.synchronize()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--buffers", type=int, default=8)
    a = ap.parse_args()
    rows, inter, hidden = 4096, 14336, 4096
    dev = [torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16) for _ in range(a.buffers)]
    host = [torch.empty(rows, inter, dtype=torch.bfloat16, pin_memory=True) for _ in range(a.buffers)]
    side = torch.cuda.Stream()
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "buffer_mb": dev[0].numel() * 2 / MB}
    for _ in range(2):
        res["d2h_gbps"] = _copy_rate(host, dev, side)
        res["h2d_gbps"] = _copy_rate(dev, host, side)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16)
    _products(x, w, out, 200)  # warm up and heat the GPU to its steady clocks
    n = 400
    res["product_alone_ms"] = _products(x, w, out, n)
    for mode in ("out", "in", "both"):
        # Copy events bracket only the copies on the side stream; the products run meanwhile.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record(side)
            nbytes = 0
            for _ in range(4):
                for d, h in zip(dev, host):
                    if mode in ("out", "both"):
                        h.copy_(d, non_blocking=True)
                        nbytes += d.numel() * 2
                    if mode in ("in", "both"):
                        d.copy_(h, non_blocking=True)
                        nbytes += d.numel() * 2
            end.record(side)
        ms = _products(x, w, out, n)
        end.synchronize()
        res[f"product_ms_copying_{mode}"] = ms
        res[f"copy_gbps_{mode}_under_products"] = nbytes / (start.elapsed_time(end) * 1e-3) / 1e9
        res[f"copy_span_ms_{mode}"] = start.elapsed_time(end)
    res["product_alone_ms_after"] = _products(x, w, out, n)
    res.update(_python_under_copies(dev, host))
    flops = 2 * rows * hidden * inter
    res["product_tflops_alone"] = flops / (res["product_alone_ms"] * 1e-3) / 1e12
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
