"""NF4 (QLoRA base) decode at batch 1 and 8 against the bound from the bytes a step reads.

    python bench/nf4_decode.py --out $OUT/nf4_decode.json            # Llama-3.1-8B shape, ~5 min (H100)
    python bench/nf4_decode.py --smoke --out /tmp/nf4_smoke.json      # tiny model, checks the script

Run bench/nf4_gemv_sweep.py first on the same machine: its measured plans (tiles per shape and
row count, and whether the kernel takes one row) are what the decode path reads; without them
the cost model's tiles are used and one row stays on bitsandbytes.

Random-init weights at the real shape (bench/decode.py's model), every linear but lm_head
quantized to NF4 (bitsandbytes, double quant, bf16 compute). Workload: a 512-token prompt, 256
new tokens, greedy, no stop tokens. Rows:
  - `nf4`: Kestrel's decode path: at 2-16 rows the NF4 groups read by `kernels/decode/nf4_gemv.py`
    (one launch per q/k/v, o, gate/up, down) in a compiled, graph-captured step; at one row too
    where every group's measured plan found the kernel faster than bitsandbytes' GEMV, else the
    bitsandbytes modules at one row (`nf4_min_rows` in the report);
  - `nf4_kernel_1row` (only when `nf4` kept the modules at one row): batch 1 with the kernel at
    one row too (`nf4_gemv.MIN_ROWS` = 1): exact dequantized values (bitsandbytes' GEMV
    multiplies in bf16), compiled;
  - `nf4_modules`: the same generator with that kernel turned off (each bitsandbytes module
    called: 4-bit GEMV at batch 1, dequantize + GEMM above; eager in the graph), the previous path;
  - `bf16_dequantized`: every NF4 linear replaced by an nn.Linear holding its dequantized bf16
    weight (the dequantized 16-bit path), default settings (fused groups, batch-1 fast layer)
    and with `fuse=False` (the same general step as `nf4`, only the products differ).
The greedy tokens of `nf4` and `nf4_kernel_1row` (all rows, all 256) are compared with both
dequantized runs and with `nf4_modules` (`tokens_match`).

Bound: a step reads, per group, what its path reads at that batch (`step_bytes`): for the kernel
the packed nibbles, the fp32 absmax decoded at build time and the biases (`NF4Weight.nbytes`);
for a module its packed nibbles and uint8 absmax with the nested scales; dense weights (lm_head,
bf16) in full;
the norm weights; one embedding row per batch row; and the KV cache up to the current column
(its mean over the run: prompt + new / 2). bound steps/s = copy bandwidth (read + write of a
1 GiB copy, `bench.common.copy_bandwidth`) / bytes; tokens/s bound = batch x that. Reported:
`of_bound` = decode tokens/s (first token excluded) / bound tokens/s, and `total_of_bound`
with tokens/s over the whole call (prefill included).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import copy_bandwidth  # noqa: E402
from bench.decode import Report, build_model, guarded, kestrel_runner, measure, prompts, quantize_nf4  # noqa: E402
from kestrel.kernels.decode import nf4_gemv  # noqa: E402


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def module_bytes(module: torch.nn.Module) -> int:
    """What a module's forward reads of its weight: a Linear4bit's packed bytes and stored scales
    (uint8 absmax, nested fp32 scales and offset), or a dense weight; plus its bias."""
    w = module.weight
    state = getattr(w, "quant_state", None)
    if state is None:
        return tensor_bytes(w, module.bias)
    scales = tensor_bytes(state.absmax)
    if getattr(state, "nested", False):
        scales += tensor_bytes(state.state2.absmax, state.state2.code, state.offset)
    return tensor_bytes(w, module.bias) + scales


def step_bytes(backend: Any, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` rows reads at a mean cache length of `context` columns."""
    from kestrel.decode.projections import base_module

    total = 0
    for g in backend.groups:
        if g.nf4 is not None and g.nf4.min_rows <= batch <= nf4_gemv.MAX_ROWS:
            total += g.nf4.nbytes
        else:
            total += sum(module_bytes(base_module(m)) for m in g.modules)
    norms = [backend.final_norm] + [n for layer in backend.layers for n in (layer.input_norm, layer.post_attn_norm)]
    total += tensor_bytes(*(n.weight for n in norms))
    hidden = backend.embed.weight.shape[1]
    total += batch * hidden * backend.embed.weight.element_size()
    kv = 2 * len(backend.layers) * backend.n_kv * backend.head_dim * backend.embed.weight.element_size()
    return total + kv * batch * context


def dequantize_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every NF4 Linear4bit by an nn.Linear holding its dequantized weight (bitsandbytes'
    own dequantize, in the quant state's dtype): the dequantized 16-bit model."""
    import bitsandbytes.functional as bnbf

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            state = getattr(getattr(child, "weight", None), "quant_state", None)
            if state is None:
                continue
            dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                    device=child.weight.device, dtype=state.dtype)
            with torch.no_grad():
                dense.weight.copy_(bnbf.dequantize_4bit(child.weight, state))
                if child.bias is not None:
                    dense.bias.copy_(child.bias)
            dense.requires_grad_(False)
            setattr(parent, name, dense)
    return model.eval()


def run(args: argparse.Namespace) -> Report:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bandwidth = copy_bandwidth(device)
    model = build_model(args.smoke, device).to(torch.bfloat16)  # the smoke model is fp32 on a CPU
    model.generation_config.eos_token_id = None
    model = quantize_nf4(model)
    vocab, plen = model.config.vocab_size, args.prompt_len
    report = Report(args.out, {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "copy_bandwidth_GBps": bandwidth / 1e9, "prompt_len": plen,
        "new_tokens": args.new_tokens, "command": " ".join(sys.argv),
    })
    bench = Bench(report, [(b, prompts(b, plen, vocab)) for b in (1, args.batch)], args.new_tokens, bandwidth)
    bench.variant(model, "nf4")
    if report.data.get("nf4_min_rows", nf4_gemv.MIN_ROWS) > 1:
        with mock.patch.object(nf4_gemv, "MIN_ROWS", 1):  # the kernel at one row too
            bench.variant(model, "nf4_kernel_1row", batches=bench.batches[:1])
    if not args.skip_modules:
        bench.variant(model, "nf4_modules", compile=False, modules=True)
    if not args.skip_dense:
        model = dequantize_linears(model)
        if args.dense in ("both", "fused"):
            bench.variant(model, "bf16_dequantized")
        if args.dense in ("both", "separate"):
            bench.variant(model, "bf16_dequantized_separate", fuse=False)
    report.data["tokens_match"] = compare(bench.tokens)
    if not args.skip_dense:  # where the paths part: a tie at bf16's resolution, or not
        for entry in report.data["tokens_match"].values():
            entry.update(where_they_part(model, dict(bench.batches), bench.tokens, entry))
    print(json.dumps(report.data["tokens_match"], indent=1))
    return report


class Bench:
    """Runs generator variants over the same prompts; keeps every variant's tokens."""

    def __init__(self, report: Report, batches: list[tuple[int, torch.Tensor]], new: int, bandwidth: float):
        self.report, self.batches, self.new, self.bandwidth = report, batches, new, bandwidth
        self.context = batches[0][1].shape[1] + new // 2  # the KV read grows over the run: its mean
        self.max_seq_len = 2 * (batches[0][1].shape[1] + new)
        self.tokens: dict[str, dict[int, list[list[int]]]] = {}

    def variant(self, model: torch.nn.Module, name: str, batches: list | None = None, modules: bool = False,
                **kw: Any) -> None:
        """One generator (`kw`: Generator options; `modules`: NF4 groups called as modules)."""
        from kestrel.decode import Generator

        gen = Generator(model, stop_ids=[], max_seq_len=self.max_seq_len, **kw)
        if modules:
            for g in gen.backend.groups:
                g.nf4 = None
        elif name == "nf4":
            self.report.data["nf4_min_rows"] = gen.backend.nf4_min_rows
            self.report.data["nf4_plans"] = {f"{g.nf4.n}x{g.nf4.k}": {
                "measured": g.nf4.plan is not None, "min_rows": g.nf4.min_rows,
                "register_table": g.nf4.register_table,  # False: tiles asking for PRMT ran NIBBLE
                "tiles": {m: list(g.nf4.tiles_for(m)) for m in (1, 2, 8, 16)}} for g in gen.backend.groups if g.nf4}
        self.tokens[name] = {}
        for batch, ids in batches or self.batches:
            guarded(self.report, name, batch, lambda batch=batch, ids=ids, gen=gen: self.one(gen, name, batch, ids))
        gen.close()
        del gen
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def one(self, gen: Any, name: str, batch: int, ids: torch.Tensor) -> dict:
        """Speed (best of 3 timed calls after a warm one), the bound at this batch, all tokens."""
        row = measure(name, batch, self.new, kestrel_runner(gen, ids, self.new), 3)
        self.tokens[name][batch] = gen.generate(ids.tolist(), max_new_tokens=self.new).tokens
        nbytes = step_bytes(gen.backend, batch, self.context)
        bound = batch * self.bandwidth / nbytes
        return {**row, "compiled": gen.compile, "step_bytes_GB": nbytes / 1e9, "bound_tokens_per_s": bound,
                "of_bound": row["decode_tokens_per_s"] / bound, "total_of_bound": row["tokens_per_s"] / bound}


def compare(tokens: dict[str, dict[int, list[list[int]]]]) -> dict:
    """Per NF4 variant, dequantized variant and batch: are the tokens identical (every row, every
    token), and where the first difference is (row, step) if not."""
    out: dict[str, Any] = {}
    for ours in ("nf4", "nf4_kernel_1row"):
        for ref in ("bf16_dequantized", "bf16_dequantized_separate", "nf4_modules"):
            for batch, rows in tokens.get(ref, {}).items():
                mine = tokens.get(ours, {}).get(batch)
                if mine is None:
                    continue
                first = next(((r, s) for r, (a, b) in enumerate(zip(mine, rows))
                              for s, (x, y) in enumerate(zip(a, b)) if x != y), None)
                out[f"{ours}_vs_{ref}_b{batch}"] = {"identical": mine == rows, "first_difference": first,
                                                    "pair": (ours, ref, batch)}
    return out


def where_they_part(reference: torch.nn.Module, prompts_by_batch: dict[int, torch.Tensor],
                    tokens: dict[str, dict[int, list[list[int]]]], entry: dict) -> dict:
    """At an entry's first difference (row r, step s): the reference model's (the dequantized bf16
    one, run by HF) logits after the prompt and the reference's first s tokens; how far below its
    best our token is, in units of the bf16 spacing (ulp) at the best logit. The logits are bf16:
    within about one ulp the two tokens cannot be told apart, so the paths part at a tie."""
    first, name = entry.get("first_difference"), entry.get("pair")
    if first is None or name is None:
        return {}
    ours, ref, batch = name
    row, step = first
    prefix = prompts_by_batch[batch][row].tolist() + tokens[ref][batch][row][:step]
    device = next(reference.parameters()).device
    with torch.no_grad():
        logits = reference(torch.tensor([prefix], device=device)).logits[0, -1].float()
    best = float(logits.max())
    mine = tokens[ours][batch][row][step]
    ulp = 2.0 ** (math.floor(math.log2(abs(best))) - 7) if best else 2.0**-133  # bf16: 8 significant bits
    short = best - float(logits[mine])
    return {"best_logit": best, "ours_below_best": short, "ours_below_best_ulps": short / ulp,
            "ours_rank": int((logits > logits[mine]).sum())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="a tiny Llama instead of the 8B shape")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--skip-modules", action="store_true", help="skip the previous path (modules called)")
    p.add_argument("--skip-dense", action="store_true", help="skip the dequantized 16-bit runs (no token check)")
    p.add_argument("--dense", choices=("both", "fused", "separate"), default="both",
                   help="which dequantized 16-bit runs check the tokens (separate: the same step as nf4's)")
    args = p.parse_args()
    start = time.perf_counter()
    report = run(args)
    report.data["wall_s"] = round(time.perf_counter() - start, 1)
    report.write()
    for r in report.results:
        if "error" not in r:
            print(f"{r['name']:26s} b{r['batch']:<2d} {r['tokens_per_s']:7.1f} tok/s, decode "
                  f"{r['decode_tokens_per_s']:7.1f}, bound {r['bound_tokens_per_s']:7.1f}: "
                  f"{r['of_bound']:.0%} of it (whole call {r['total_of_bound']:.0%})")
    print(f"wrote {args.out} in {report.data['wall_s']} s")


if __name__ == "__main__":
    main()
