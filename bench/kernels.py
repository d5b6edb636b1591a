"""Forward + backward of every public kernel op: Kestrel vs PyTorch eager vs Liger (and Cut
Cross-Entropy for the loss), at LLM shapes on one CUDA GPU.

For each op and shape: correctness first (max error of outputs and every gradient against eager
PyTorch on the same inputs), then the median of N timed forward+backward steps (CUDA events,
after warmup; per-step setup such as fresh gradients is outside the timed region). Memory-bound
ops report achieved GB/s = bytes that must move / time, next to the measured device copy
bandwidth (a large `copy_`, read + write) as the ceiling; the loss reports peak extra memory.

Run from the repository root (Liger-Kernel / cut_cross_entropy optional, on PYTHONPATH):
    python bench/kernels.py --out bench/kernels.json
`--graphed` adds, for memory-bound ops, the step replayed as a CUDA graph: the GPU's time alone.
At 8K tokens a call moves 64-200 MB (20-70 us of copy bandwidth) while the host's per-call work
(Python, autograd, launches) takes longer, so per-call timings there measure the host.
Takes about 2-3 minutes on one H100. `--smoke` runs tiny shapes (on the CPU through Triton's
interpreter when there is no GPU) to check that the script itself works.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("KESTREL_KERNELS", "triton")
if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from bench.common import copy_bandwidth  # noqa: E402
from kestrel.kernels.glu import geglu, swiglu  # noqa: E402
from kestrel.kernels.rms_norm import rms_norm  # noqa: E402
from kestrel.kernels.rope import rope_  # noqa: E402

try:
    from kestrel.kernels.cross_entropy import fused_linear_cross_entropy
except ImportError:
    fused_linear_cross_entropy = None
try:
    from kestrel.kernels.lora.lora import LoRAWeights
    from kestrel.kernels.lora.mlp import lora_mlp
except ImportError:
    LoRAWeights = lora_mlp = None
try:
    from liger_kernel.transformers import functional as liger
except Exception as exc:  # noqa: BLE001 - a missing or broken optional baseline only drops a column
    print(f"liger_kernel unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
    liger = None
try:
    from cut_cross_entropy import linear_cross_entropy as cce_loss
except Exception as exc:  # noqa: BLE001
    print(f"cut_cross_entropy unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
    cce_loss = None

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Shapes:
    """Llama-3.1-8B widths by default; `SMOKE` is a tiny stand-in."""

    hidden: int = 4096
    intermediate: int = 14336
    heads_q: int = 32
    heads_k: int = 8
    head_dim: int = 128
    tokens: tuple[int, ...] = (8192, 32768)
    seq: int = 8192  # rope: tokens = batch x seq
    vocab: int = 128256
    loss_tokens: int = 8192
    lora_rank: int = 16
    device: str = "cuda"


SMOKE = Shapes(64, 96, 4, 2, 16, (48,), 24, 500, 40, 4, "cuda" if torch.cuda.is_available() else "cpu")
S = Shapes()

# One step: state -> [output, *gradients]. A Case couples per-step setup with each step.
Step = Callable[[dict], list[torch.Tensor]]


@dataclass
class Case:
    op: str
    shape: str
    inputs: dict[str, torch.Tensor]
    impls: dict[str, Step]
    bytes_moved: int | None = None  # None: compute-bound, no GB/s
    flops: float | None = None
    prepare: Callable[[dict], dict] = field(default=lambda inputs: inputs)
    track_memory: bool = False


# ----------------------------------------------------------------------------- measurement


def time_steps(step: Step, inputs: dict, prepare, warmup: int, iters: int) -> float:
    """Median milliseconds of `step`, each on a freshly prepared state (untimed)."""
    for _ in range(warmup):
        step(prepare(inputs))
    if S.device != "cuda":  # --smoke on a CPU: wall clock, only to exercise the code
        times = []
        for _ in range(iters):
            state = prepare(inputs)
            start = time.perf_counter()
            step(state)
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        state = prepare(inputs)
        start.record()
        step(state)
        end.record()
        del state
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def graph_replay_ms(step: Step, inputs: dict, prepare, iters: int, repeats: int = 20) -> float:
    """Median milliseconds of `step` replayed as a CUDA graph: the GPU's time alone, without the
    host's per-call work (Python, autograd, launches), which is what bounds the small shapes when
    each call is timed on its own. Each warm-up and the capture get a fresh state, prepared
    outside the graph; replays rerun in-place ops on the same buffers: values drift, the work
    does not."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        for _ in range(2):
            step(prepare(inputs))
        # Prepared on the capture stream: a backward node runs on the stream its forward ran
        # on, so a clone made on the default (legacy) stream would put a legacy-stream launch
        # into the capture (cudaErrorStreamCaptureImplicit, seen with rope_'s cloned q and k).
        state = prepare(inputs)
        with torch.cuda.graph(graph, stream=side):
            step(state)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    del graph, state
    return statistics.median(times)


def peak_extra_gib(step: Step, inputs: dict, prepare) -> float | None:
    """Peak memory above what was allocated before the step (returned gradients included)."""
    if S.device != "cuda":
        return None
    state = prepare(inputs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = step(state)
    torch.cuda.synchronize()
    del out, state
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def max_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, float]:
    """(max abs error, max abs error / max |reference|) over all tensors."""
    abs_err, rel_err = 0.0, 0.0
    for g, w in zip(got, want):
        diff = (g.float() - w.float()).abs().max().item()
        scale = w.float().abs().max().item()
        abs_err, rel_err = max(abs_err, diff), max(rel_err, diff / max(scale, 1e-12))
    return abs_err, rel_err


def grad_of(out, leaves, grads) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, grads))


def randn(*shape, scale: float = 1.0, requires_grad: bool = False, dtype=DTYPE) -> torch.Tensor:
    return (scale * torch.randn(*shape, device=S.device)).to(dtype).requires_grad_(requires_grad)


# ----------------------------------------------------------------------------- cases


def rms_norm_case(tokens: int) -> Case:
    def eager(x, w, eps):  # LlamaRMSNorm
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    inputs = {"x": randn(tokens, S.hidden, requires_grad=True), "g0": randn(tokens, S.hidden),
              "w": randn(S.hidden, scale=0.1).add_(1).requires_grad_()}
    impls: dict[str, Step] = {
        "kestrel": lambda s: grad_of(rms_norm(s["x"], s["w"], 1e-6), (s["x"], s["w"]), s["g"]),
        "torch": lambda s: grad_of(eager(s["x"], s["w"], 1e-6), (s["x"], s["w"]), s["g"]),
    }
    if liger is not None:
        impls["liger"] = lambda s: grad_of(liger.liger_rms_norm(s["x"], s["w"], 1e-6), (s["x"], s["w"]), s["g"])
    return Case(
        "rms_norm", f"{tokens}x{S.hidden}", inputs, impls,
        bytes_moved=5 * tokens * S.hidden * 2,  # fwd: read x, write y; bwd: read x, dy, write dx
        prepare=lambda i: {**i, "g": i["g0"].clone()},  # a copy: Liger writes dx over dy
    )


def _rope_tables(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, S.head_dim, 2, device=S.device).float() / S.head_dim))
    freqs = torch.outer(torch.arange(seq, device=S.device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # (1, seq, head_dim)
    return emb.cos().to(DTYPE), emb.sin().to(DTYPE)


def rope_case(tokens: int) -> Case:
    seq = S.seq
    batch = tokens // seq

    def eager(q, k, cos, sin):  # HF apply_rotary_pos_emb
        def rot(x):
            return torch.cat((-x[..., S.head_dim // 2:], x[..., : S.head_dim // 2]), dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    def prepare(i: dict) -> dict:
        # As in HF attention: (batch, seq, heads * head_dim) -> view -> transpose; untimed clone
        # so each step has fresh non-leaf q, k to rotate in place.
        q = i["q"].clone().view(batch, seq, S.heads_q, S.head_dim).transpose(1, 2)
        k = i["k"].clone().view(batch, seq, S.heads_k, S.head_dim).transpose(1, 2)
        return {**i, "qv": q, "kv": k, "g": (i["gq0"].clone(), i["gk0"].clone())}

    cos, sin = _rope_tables(seq)
    inputs = {"q": randn(batch, seq, S.heads_q * S.head_dim, requires_grad=True),
              "k": randn(batch, seq, S.heads_k * S.head_dim, requires_grad=True), "cos": cos, "sin": sin,
              # output gradients laid out as q, k are (as SDPA's backward returns them)
              "gq0": randn(batch, seq, S.heads_q, S.head_dim).transpose(1, 2),
              "gk0": randn(batch, seq, S.heads_k, S.head_dim).transpose(1, 2)}

    def step(fn):
        return lambda s: grad_of(fn(s["qv"], s["kv"], s["cos"], s["sin"]), (s["q"], s["k"]), s["g"])

    impls = {"kestrel": step(rope_), "torch": step(eager)}
    if liger is not None:
        impls["liger"] = step(liger.liger_rope)
    qk_bytes = tokens * (S.heads_q + S.heads_k) * S.head_dim * 2
    return Case("rope_", f"{batch}x{seq} q{S.heads_q} k{S.heads_k} d{S.head_dim}", inputs, impls,
                bytes_moved=4 * qk_bytes, prepare=prepare)  # read + write q, k; then dq, dk


def glu_case(name: str, tokens: int) -> Case:
    ours = swiglu if name == "swiglu" else geglu

    def eager(a, b):
        act = F.silu(a) if name == "swiglu" else F.gelu(a, approximate="tanh")
        return act * b

    def prepare(i: dict) -> dict:
        # Fresh non-leaf gate/up (as gate_proj(x), up_proj(x) are) for the in-place backward.
        return {**i, "av": i["a"] * 1, "bv": i["b"] * 1, "g": i["g0"].clone()}

    inputs = {"a": randn(tokens, S.intermediate, scale=2.0, requires_grad=True),
              "b": randn(tokens, S.intermediate, requires_grad=True), "g0": randn(tokens, S.intermediate)}

    def step(fn):
        return lambda s: grad_of(fn(s["av"], s["bv"]), (s["av"], s["bv"]), s["g"])

    impls = {"kestrel": step(ours),
             "kestrel_inplace": step(lambda a, b: ours(a, b, inplace_backward=True)),
             "torch": step(eager)}
    liger_fn = getattr(liger, "liger_swiglu" if name == "swiglu" else "liger_geglu", None)
    if liger_fn is not None:
        impls["liger"] = step(liger_fn)
    return Case(name, f"{tokens}x{S.intermediate}", inputs, impls,
                bytes_moved=8 * tokens * S.intermediate * 2,  # fwd 2 in 1 out; bwd 3 in 2 out
                prepare=prepare)


def loss_case() -> Case | None:
    inputs = {"h": randn(S.loss_tokens, S.hidden, requires_grad=True),
              "w": randn(S.vocab, S.hidden, scale=0.02, requires_grad=True),
              "y": torch.randint(0, S.vocab, (S.loss_tokens,), device=S.device)}

    def step(fn):
        def run(s):
            out = fn(s["h"], s["w"], s["y"])
            out = out[0] if isinstance(out, (tuple, list)) else out
            return grad_of(out.float(), (s["h"], s["w"]), None)
        return run

    impls = {"torch": step(lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y))}
    if fused_linear_cross_entropy is not None:
        impls = {"kestrel": step(fused_linear_cross_entropy), **impls}
    if liger is not None:
        impls["liger"] = step(liger.liger_fused_linear_cross_entropy)
    if cce_loss is not None:
        impls["cce"] = step(cce_loss)
    return Case("fused_linear_cross_entropy", f"{S.loss_tokens}x{S.hidden} V{S.vocab}", inputs, impls,
                flops=6.0 * S.loss_tokens * S.hidden * S.vocab, track_memory=True)


def lora_mlp_case(tokens: int) -> Case | None:
    if lora_mlp is None:
        return None
    names = ("gate", "up", "down")
    shapes = {"gate": (S.intermediate, S.hidden), "up": (S.intermediate, S.hidden), "down": (S.hidden, S.intermediate)}
    inputs: dict[str, torch.Tensor] = {"x": randn(tokens, S.hidden, requires_grad=True), "g0": randn(tokens, S.hidden)}
    for n in names:
        out_f, in_f = shapes[n]
        inputs[f"{n}_w"] = randn(out_f, in_f, scale=in_f ** -0.5)
        inputs[f"{n}_a"] = randn(S.lora_rank, in_f, scale=in_f ** -0.5, requires_grad=True, dtype=torch.float32)
        inputs[f"{n}_b"] = randn(out_f, S.lora_rank, scale=0.01, requires_grad=True, dtype=torch.float32)
    scaling = 2.0
    leaves = lambda s: [s["x"]] + [s[f"{n}_{p}"] for n in names for p in "ab"]  # noqa: E731

    def eager_proj(x, s, n):
        a, b = s[f"{n}_a"].to(x.dtype), s[f"{n}_b"].to(x.dtype)
        return F.linear(x, s[f"{n}_w"]) + scaling * F.linear(F.linear(x, a), b)

    def eager(s):
        h = F.silu(eager_proj(s["x"], s, "gate")) * eager_proj(s["x"], s, "up")
        return eager_proj(h, s, "down")

    def ours(s):
        ws = [LoRAWeights(s[f"{n}_w"], None, s[f"{n}_a"], s[f"{n}_b"], scaling) for n in names]
        return lora_mlp(s["x"], *ws, activation="swiglu")

    prepare = lambda i: {**i, "g": i["g0"].clone()}  # noqa: E731
    impls = {"kestrel": lambda s: grad_of(ours(s), leaves(s), s["g"]),
             "torch": lambda s: grad_of(eager(s), leaves(s), s["g"])}
    # Frozen base: forward 3 matmuls, backward dX only (3 more): 12 M H I useful FLOPs.
    return Case("lora_mlp", f"{tokens}x{S.hidden} I{S.intermediate} r{S.lora_rank}", inputs, impls,
                flops=12.0 * tokens * S.hidden * S.intermediate, prepare=prepare)


# ----------------------------------------------------------------------------- driver


def all_cases(ops: set[str] | None) -> list[Callable[[], Case | None]]:
    makers: list[tuple[str, Callable[[], Case | None]]] = []
    for tokens in S.tokens:
        makers += [("rms_norm", lambda t=tokens: rms_norm_case(t)), ("rope_", lambda t=tokens: rope_case(t)),
                   ("swiglu", lambda t=tokens: glu_case("swiglu", t)), ("geglu", lambda t=tokens: glu_case("geglu", t))]
    makers.append(("fused_linear_cross_entropy", loss_case))
    makers += [("lora_mlp", lambda t=tokens: lora_mlp_case(t)) for tokens in S.tokens]
    return [make for op, make in makers if ops is None or op in ops]


def run_case(case: Case, copy_gbs: float, warmup: int, iters: int, graphed: bool = False) -> list[dict[str, Any]]:
    """Correctness of every implementation against eager torch, then timing (and memory);
    `graphed`: also the GPU's time alone for memory-bound ops (`graph_replay_ms`)."""
    reference = case.impls["torch"](case.prepare(case.inputs))
    rows = []
    for name, step in case.impls.items():
        row: dict[str, Any] = {"op": case.op, "shape": case.shape, "impl": name}
        try:
            got = step(case.prepare(case.inputs))
            row["max_abs_err"], row["rel_err"] = max_errors(got, reference)
            del got
            ms = time_steps(step, case.inputs, case.prepare, warmup, iters)
            row["ms"] = ms
            if case.bytes_moved is not None:
                row["gbs"] = case.bytes_moved / (ms * 1e-3) / 1e9
                row["frac_of_copy"] = row["gbs"] / copy_gbs
                if S.device == "cuda" and graphed:
                    row["graph_ms"] = graph_replay_ms(step, case.inputs, case.prepare, iters)
                    row["graph_frac_of_copy"] = case.bytes_moved / (row["graph_ms"] * 1e-3) / 1e9 / copy_gbs
            if case.flops is not None:
                row["tflops"] = case.flops / (ms * 1e-3) / 1e12
            if case.track_memory:
                row["peak_extra_gib"] = peak_extra_gib(step, case.inputs, case.prepare)
        except Exception as exc:  # noqa: BLE001 - one broken implementation must not stop the run
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        if S.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]], copy_gbs: float) -> str:
    lines = [f"Device copy bandwidth (ceiling): {copy_gbs:,.0f} GB/s", "",
             "| op | shape | impl | fwd+bwd ms | GB/s | % of copy | graph replay ms | % of copy (graph) "
             "| TFLOP/s | max abs err | rel err | peak extra GiB | note |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        frac, gfrac = r.get("frac_of_copy"), r.get("graph_frac_of_copy")
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['impl']} | {_fmt(r.get('ms'), '.3f')} | {_fmt(r.get('gbs'), ',.0f')} "
            f"| {_fmt(None if frac is None else 100 * frac, '.0f')} | {_fmt(r.get('graph_ms'), '.3f')} "
            f"| {_fmt(None if gfrac is None else 100 * gfrac, '.0f')} | {_fmt(r.get('tflops'), '.0f')} "
            f"| {_fmt(r.get('max_abs_err'), '.2e')} | {_fmt(r.get('rel_err'), '.2e')} "
            f"| {_fmt(r.get('peak_extra_gib'), '.2f')} | {r.get('error', '')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--ops", default="", help="comma-separated subset of ops (default: all)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; CPU interpreter without a GPU")
    parser.add_argument("--graphed", action="store_true",
                        help="also time each memory-bound step replayed as a CUDA graph (the GPU's time alone)")
    args = parser.parse_args()
    global S
    if args.smoke:
        S, args.warmup, args.iters = SMOKE, 1, 2
    elif not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA device (or --smoke)")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth(torch.device(S.device)) / 1e9  # NaN off a GPU (--smoke)
    rows: list[dict[str, Any]] = []
    for make in all_cases({o.strip() for o in args.ops.split(",") if o.strip()} or None):
        case = make()
        if case is None:
            continue
        rows += run_case(case, copy_gbs, args.warmup, args.iters, args.graphed)
        print(markdown(rows[-len(case.impls):], copy_gbs).split("\n", 4)[-1], flush=True)
        del case
        if S.device == "cuda":
            torch.cuda.empty_cache()
    table = markdown(rows, copy_gbs)
    print("\n" + table)
    meta = {
        "device": torch.cuda.get_device_name() if S.device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__, "shapes": S.__dict__,
        "triton": __import__("triton").__version__,
        "liger_kernel": liger is not None,
        "cut_cross_entropy": cce_loss is not None, "copy_gbs": copy_gbs,
        "missing": [n for n, m in (("liger_kernel", liger), ("cut_cross_entropy", cce_loss),
                                   ("kestrel.kernels.cross_entropy", fused_linear_cross_entropy),
                                   ("kestrel.kernels.lora.lora", lora_mlp)) if m is None],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
