"""How many forwards the CUDA-graph chooser takes to decide every layout of a matrix layout's batches, on the CPU:
the batches' token counts (`bench.matrix.plan_batches`, Kestrel's flat rows) replayed through `GraphChooser` with a
fake clock and a stated cost model (host-bound: eager steps take at least `--host-s`, graphed ones cost the GPU's
work, `--gpu-s-per-token` a token, 2% more). Prints, for the chooser's defaults and for the old settings (three
untimed graphed forwards, nothing decisive), the forwards until every layout seen is decided and how many of
them ran eagerly. No GPU, nothing timed for real.

    python bench/chooser_probes.py --layout padded
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.matrix import plan_batches  # noqa: E402
from kestrel.recompute.graph_choice import GraphChooser, WallClock  # noqa: E402


def probe(tokens: list[int], cost, most: int = 2000, **chooser_args) -> tuple[int | None, int]:
    """(forwards until every layout seen is decided, or None within `most`; eager forwards until then)."""
    now = [0.0]
    chooser = GraphChooser("auto", WallClock(lambda: now[0]), **chooser_args)
    eager = 0
    for i in range(most):
        n = tokens[i % len(tokens)]
        graphed = chooser.begin(("layout", n), n)
        eager += not graphed
        now[0] += cost(n, graphed)
        if i >= len(tokens) and len(chooser.decisions()) == len(chooser.layouts):
            return i + 1, eager
    return None, eager


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="padded", help="padded, packed or long (bench/matrix.py's layouts)")
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host-s", type=float, default=0.25, help="an eager step's floor: the host's Python")
    ap.add_argument("--gpu-s-per-token", type=float, default=1e-5)
    args = ap.parse_args()
    tokens = [b.input_ids.numel() for b in plan_batches(args.layout, 1000, True, args.batches, args.seed)]
    print(f"{len(set(tokens))} layouts in {len(tokens)} batches: {tokens}")

    def cost(n: int, graphed: bool) -> float:
        gpu = n * args.gpu_s_per_token
        return gpu * 1.02 + 0.001 if graphed else max(gpu, args.host_s)

    for name, kwargs in (("defaults", {}), ("old: 3 graphed warm-ups, nothing decisive",
                                            {"warmup": 3, "decisive": float("inf")})):
        forwards, eager = probe(tokens, cost, **kwargs)
        print(f"{name}: every layout decided after {forwards} forwards, {eager} of them eager")


if __name__ == "__main__":
    main()
