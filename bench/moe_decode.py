"""One MoE layer's decode-step expert products at Qwen3-30B-A3B and gpt-oss-20b shapes: the gathered
copy + batched matmul (`expert_gemv.gathered_products`, the path before) against the kernel that reads
the chosen experts in place (`expert_gemv.expert_gemv`), 16-bit (bf16) and NF4 experts, at batch 1
and 8 rows (M = k and 8k pairs).

Each figure is one launch of a projection (gate_up, down) averaged over LAUNCHES launches captured
in a CUDA graph, each launch with its own random expert ids (so the chosen experts come from HBM,
not from the previous launch's L2); `layer` rows add gate_up and down. GB/s counts the bytes the
products need: each distinct chosen expert's stored weights once (NF4: codes and absmax).

    python bench/moe_decode.py --out moe_decode.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # before bench/kernels.py shadows the package

from bench.decode_kernels import LAUNCHES, timed  # noqa: E402  (us a launch, LAUNCHES launches in one CUDA graph)
from kestrel.kernels.decode.expert_gemv import expert_gemv, expert_weights, gathered_products  # noqa: E402
from kestrel.kernels.moe import PackedExperts  # noqa: E402

# model: (experts, top-k, {projection: (stored (E, a, b) minus E, transposed)})
MODELS = {
    "qwen3-30b-a3b": (128, 8, {"gate_up": ((2 * 768, 2048), False), "down": ((2048, 768), False)}),
    "gpt-oss-20b": (32, 4, {"gate_up": ((2880, 2 * 2880), True), "down": ((2880, 2880), True)}),
}
ROWS = (1, 8)


def expert_bytes(source: torch.Tensor | PackedExperts) -> float:
    """Stored bytes of one expert (NF4: codes, absmax and its share of the second-level scales; the
    code tables, read from cache, are left out)."""
    if isinstance(source, PackedExperts):
        state = source.state
        scales = [state.absmax] + ([state.state2.absmax] if state.nested else [])
        return sum(t.numel() * t.element_size() for t in [source.packed, *scales]) / source.stored_shape[0]
    return source[0].numel() * source.element_size()


def needed_bytes(ids: list[torch.Tensor], source: torch.Tensor | PackedExperts) -> float:
    """Mean over the launches' id sets of (distinct experts x one expert's stored bytes)."""
    distinct = sum(int(torch.unique(i).numel()) for i in ids) / len(ids)
    return distinct * expert_bytes(source)


def projection_rows(model: str, name: str, e: int, top_k: int, stored: tuple[int, int], transposed: bool) -> list[dict]:
    """Gather and kernel, bf16 and NF4, batch 1 and 8, for one projection's experts."""
    a, b = stored
    k = a if transposed else b
    w = torch.randn(e, a, b, device="cuda", dtype=torch.bfloat16) * k**-0.5
    rows = []
    for kind, source in (("bf16", w), ("nf4", PackedExperts(w, transposed))):
        weights = expert_weights(source, transposed)
        for batch in ROWS:
            m = batch * top_k
            ids = [torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(batch)]).reshape(-1)
                   for _ in range(LAUNCHES)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            need = needed_bytes(ids, source)
            for impl, fn in (("gather", lambda i: gathered_products(x, ids[i], source, transposed)),
                             ("kernel", lambda i: expert_gemv(x, ids[i], weights))):
                us = timed(fn)
                rows.append({"model": model, "projection": name, "weights": kind, "rows": batch, "pairs": m,
                             "impl": impl, "us": round(us, 2), "needed_bytes": round(need),
                             "gb_per_s": round(need / us / 1e3, 1)})
    return rows


def layer_rows(rows: list[dict]) -> list[dict]:
    """gate_up + down per (model, weights, rows, impl), and gather / kernel time ratios."""
    out = []
    keys = sorted({(r["model"], r["weights"], r["rows"]) for r in rows})
    for model, kind, batch in keys:
        per = {}
        for impl in ("gather", "kernel"):
            sel = [r for r in rows if (r["model"], r["weights"], r["rows"], r["impl"]) == (model, kind, batch, impl)]
            us, need = sum(r["us"] for r in sel), sum(r["needed_bytes"] for r in sel)
            per[impl] = us
            out.append({"model": model, "projection": "layer", "weights": kind, "rows": batch, "impl": impl,
                        "us": round(us, 2), "gb_per_s": round(need / us / 1e3, 1)})
        out.append({"model": model, "projection": "layer", "weights": kind, "rows": batch,
                    "speedup": round(per["gather"] / per["kernel"], 2)})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("moe_decode.json"), help="JSON results file")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/moe_decode.py times CUDA kernels: run it on a GPU machine")
    rows = []
    for model in args.models:
        e, top_k, projections = MODELS[model]
        for name, (stored, transposed) in projections.items():
            rows += projection_rows(model, name, e, top_k, stored, transposed)
            torch.cuda.empty_cache()
    rows += layer_rows(rows)
    for r in rows:
        print(json.dumps(r))
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
