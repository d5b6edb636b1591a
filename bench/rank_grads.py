"""An adapter's two rank-r products over dy, one pass (`kestrel.kernels.lora.rank_grads`) against cuBLAS's two.

    python bench/rank_grads.py --out rank_grads.json [--sweep]

For every distinct projection output width N of the matrix's dense models (hidden sizes, Q, K/V and
intermediate widths), at M = 4,096 and 8,192 rows, r = 16 (and 32 on a few; at 64 the one pass is not used): dyb = dy B (M, r) and
dB = dy^T xa (N, r) in fp32, bf16 operands. Timed (CUDA events, median of 50 after 10 warm-ups): cuBLAS's
two products as `_adapter_backward` ran them (`torch.mm` and `casts.mm_to`), then the one-pass kernel with
its reductions; each checked against the products in fp32. The bound is reading dy once at the device's copy
bandwidth. The model to test: the one pass is faster wherever cuBLAS's two passes are each far from that
bound, which they are when N, r or both are small; at wide N cuBLAS's products sit near the bound and the
one pass (plus its slabs) saves up to half.

--sweep first times a few tilings (`Tiles`: rows a step, columns a program, warps, stages) on four tuning shapes
(8,192 rows at widths 512, 2,048 and 8,192; 2,048 rows, a deferred MLP chunk, at 8,192) and names the one with the
best geometric-mean speedup over cuBLAS; the full report then runs with it, so its numbers on the other widths are
on shapes the choice was not made on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import copy_bandwidth, cuda_time  # noqa: E402
from bench.model_shapes import MODELS  # noqa: E402
from kestrel.kernels.lora.rank_grads import DEFAULT_TILES, Tiles, _grid, rank_grads, rank_grads_reference  # noqa: E402,E501


def widths() -> list[int]:
    """Every distinct projection output width of the dense models in the matrix's list."""
    out: set[int] = set()
    for cfg in MODELS.values():
        if "intermediate_size" not in cfg or cfg.get("num_experts") or cfg.get("num_local_experts"):
            continue
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        out |= {cfg["hidden_size"], cfg["intermediate_size"], heads * head_dim,
                cfg.get("num_key_value_heads", heads) * head_dim}
    return sorted(out)


CANDIDATES = [DEFAULT_TILES, Tiles(32, 256, 8, 3), Tiles(64, 256, 8, 3), Tiles(32, 128, 4, 3), Tiles(64, 128, 4, 3),
              Tiles(32, 256, 4, 4), Tiles(16, 256, 4, 3), Tiles(32, 256, 4, 2)]
TUNE = [(8192, 512), (8192, 2048), (8192, 8192), (2048, 8192)]


def sweep() -> tuple[Tiles, list[dict]]:
    """Each candidate's speedup over cuBLAS on the tuning shapes (r = 16) and its geometric mean; the best."""
    rows = []
    for tiles in CANDIDATES:
        ratios = []
        for m, n in TUNE:
            dy, b, xa = _operands(m, n, 16)
            try:
                one = cuda_time(lambda: rank_grads(dy, b, xa, tiles), warmup=10, iters=50)
            except Exception as err:  # a tiling the compiler refuses (registers, shared memory): not a candidate
                rows.append(dict(tiles=list(tiles), error=repr(err)[:200]))
                break
            ratios.append(cuda_time(lambda: rank_grads_reference(dy, b, xa), warmup=10, iters=50) / one)
        else:
            mean = 1.0
            for x in ratios:
                mean *= x ** (1 / len(ratios))
            rows.append(dict(tiles=list(tiles), speedups=ratios, geomean=mean))
            print(f"tiles {tuple(tiles)}: " + " ".join(f"{x:.2f}x" for x in ratios) + f"  geomean {mean:.2f}x", flush=True)
    best = max((r for r in rows if "geomean" in r), key=lambda r: r["geomean"])
    return Tiles(*best["tiles"]), rows


def _operands(m: int, n: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    dy = torch.randn(m, n, device="cuda", generator=g, dtype=torch.bfloat16)
    b = (torch.randn(n, r, device="cuda", generator=g) / 8).to(torch.bfloat16)
    xa = torch.randn(m, 3 * r, device="cuda", generator=g, dtype=torch.bfloat16)[:, r:2 * r]  # a stacked slice
    return dy, b, xa


def measure(m: int, n: int, r: int, bandwidth: float, tiles: Tiles = DEFAULT_TILES) -> dict:
    dy, b, xa = _operands(m, n, r)
    exact = (dy.float() @ b.float(), dy.float().t() @ xa.float())
    got, ref = rank_grads(dy, b, xa, tiles), rank_grads_reference(dy, b, xa)
    errors = [max(((x.float() - e).abs().max() / e.abs().max()).item() for x, e in zip(pair, exact))
              for pair in (got, ref)]
    one = cuda_time(lambda: rank_grads(dy, b, xa, tiles), warmup=10, iters=50)
    two = cuda_time(lambda: rank_grads_reference(dy, b, xa), warmup=10, iters=50)
    bound = m * n * 2 / bandwidth  # reading dy once (the copy bandwidth counts a copy's read and write bytes)
    groups, col_blocks, _ = _grid(m, n, dy.device, tiles)
    rp = max(16, r)
    slabs = (col_blocks * m + groups * n) * rp * 4  # the one pass's fp32 partial sums, alive during the call
    return dict(m=m, n=n, r=r, one_pass_us=one * 1e6, cublas_us=two * 1e6, bound_us=bound * 1e6, slab_mib=slabs / 2**20,
                speedup=two / one, one_pass_error=errors[0], cublas_error=errors[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("rank_grads.json"))
    parser.add_argument("--sweep", action="store_true", help="time the candidate tilings first and report with the best")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    tiles, swept = sweep() if args.sweep else (DEFAULT_TILES, [])
    print(f"reporting with tiles {tuple(tiles)} (default {tuple(DEFAULT_TILES)})", flush=True)
    rows = []
    for m in (4096, 8192):
        for n in widths():
            for r in ((16, 32) if n in (2048, 4096) else (16,)):
                row = measure(m, n, r, bandwidth, tiles)
                rows.append(row)
                print(f"M {m:5d} N {n:6d} r {r:3d}  one pass {row['one_pass_us']:7.1f} us  cuBLAS x2 "
                      f"{row['cublas_us']:7.1f} us  ({row['speedup']:.2f}x)  read-once bound {row['bound_us']:6.1f} us"
                      f"  error {row['one_pass_error']:.1e} / {row['cublas_error']:.1e}  slabs {row['slab_mib']:.1f} MiB", flush=True)
    args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), bandwidth=bandwidth, tiles=list(tiles),
                                        sweep=swept, rows=rows), indent=1))


if __name__ == "__main__":
    main()
