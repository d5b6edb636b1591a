"""Training throughput and peak memory: Kestrel vs HF+PEFT+bitsandbytes vs Liger vs Unsloth.

Each implementation runs in its own process on the same random-init Llama-3.1-8B-shape model,
the same random batch, LoRA r=16 on all 7 linears, AdamW, gradient checkpointing.

    python bench/train.py --all --out results.json                 # every implementation
    python bench/train.py --impl kestrel --out one.json             # one, in this process
    options: --method qlora|lora  --batch 2 --seq 2048 --steps 10 --checkpointing off|standard|offload
             --shape llama-8b|llama-1b  --impls unsloth,kestrel,kestrel-eager,kestrel-graphed (graphs forced)
             --memory-cap-gib 80 (cap this process's GPU memory, e.g. to stand for an 80 GB card)

Model FLOPs utilisation (MFU) counts useful work only, as `../shared/docs/targets.md` defines it:
4N FLOPs a token for the frozen base's matrix products (forward 2N, input gradients 2N; N = the
weights of every linear layer and the LM head) plus causal attention, 6 * layers * hidden * T
(forward: QK^T and AV over T/2 keys on average, 2 * hidden * T; backward twice that); recomputation by
checkpointing does not count. It is reported against the dense bf16 peak of the GPU (989 TFLOP/s
on H100/H200 SXM) and against the bf16 matrix-product rate measured in the same process.

Baselines need their packages on PYTHONPATH: pass --anchors DIR (Unsloth, Liger-Kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import SHAPES, TARGETS, cuda_time, gib, random_batch, run_isolated, shape_dir  # noqa: E402
from bench.model_shapes import MODELS  # noqa: E402



def _bnb_config(dtype: torch.dtype = torch.bfloat16):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


def hf_load_kwargs(folder: Path, method: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """`from_pretrained`'s arguments for the HF baseline on GPU 0: SDPA attention, or eager where
    HF has no SDPA path for the family (attention sinks: gpt-oss), as its users load it."""
    from transformers import AutoConfig

    from kestrel.model.registry import hf_attention

    kw = dict(dtype=dtype, attn_implementation=hf_attention(AutoConfig.from_pretrained(folder)), device_map={"": 0})
    if method == "qlora":
        kw["quantization_config"] = _bnb_config(dtype)
    return kw


def hf_model(folder: Path, args: argparse.Namespace, dtype: torch.dtype = torch.bfloat16):
    """HF + PEFT (+ bitsandbytes NF4 for qlora) computing in `dtype` (fp32: the rounding reference
    of bench/parity.py)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, **hf_load_kwargs(folder, args.method, dtype))
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    if args.checkpointing != "off":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    # A mixture of experts: the MLP targets are its experts' 3-D parameters, as Kestrel targets them.
    from kestrel.model.lora import expert_parameters

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return get_peft_model(model, LoraConfig(
        r=16, lora_alpha=16, lora_dropout=0.0, target_modules=[t for t in same_targets(model) if t in present],
        bias="none", target_parameters=expert_parameters(model, TARGETS) or None))


def same_targets(model: Any) -> list[str]:
    """The LoRA targets of every system: `TARGETS` as Kestrel widens them for the family
    (`kestrel.model.lora.every_linear`: Qwen3.5's linear-attention projections too)."""
    from kestrel.model.lora import every_linear

    return every_linear(model, TARGETS)


def build(impl: str, folder: Path, args: argparse.Namespace):
    if impl == "hf":
        return hf_model(folder, args)
    if impl == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
        return hf_model(folder, args)
    if impl == "unsloth":
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(
            model_name=str(folder), max_seq_length=args.seq, dtype=torch.bfloat16,
            load_in_4bit=args.method == "qlora", local_files_only=True,
        )
        return FastLanguageModel.get_peft_model(
            model, r=16, lora_alpha=16, lora_dropout=0.0, target_modules=same_targets(model), bias="none",
            use_gradient_checkpointing={"offload": "unsloth", "standard": True, "off": False}[args.checkpointing],
        )
    from kestrel.recompute.checkpoint import set_gradient_checkpointing
    from kestrel.config import LoraSettings
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora

    model, _ = load(str(folder), args.seq, load_in_4bit=args.method == "qlora", dtype="bf16")
    for p in model.parameters():
        p.requires_grad_(False)
    model = attach_lora(model, LoraSettings(r=16, alpha=16, dropout=0.0, targets=TARGETS))
    set_gradient_checkpointing(model, args.checkpointing)
    return model


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model and batch options shared by the step-analysis scripts (profile, memory peak)."""
    ap.add_argument("--impl", default="kestrel")
    ap.add_argument("--method", default="qlora")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--checkpointing", default="standard")
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES) + sorted(MODELS),
                    help="a Llama shape, or any model of bench/matrix.py (its random-init folder)")
    ap.add_argument("--layout", default="", choices=["", "padded", "packed", "long"],
                    help="Kestrel as a bench/matrix.py cell of this layout runs (its batches, checkpointing and CUDA "
                         "allocator) instead of --batch x --seq rows of one batch: a matrix model's --shape")


def training_step(args: argparse.Namespace, losses: list[torch.Tensor] | None = None) -> Callable[[], None]:
    """args.impl's model at args.shape and one training step on a fixed random batch: forward,
    backward, fused AdamW, gradients cleared; each step's loss appended to `losses` if given.
    With args.layout: a matrix cell's step instead (`bench.matrix_cell.cell_step`; `losses` not kept)."""
    if getattr(args, "layout", ""):
        from bench.matrix_cell import cell_step

        if args.impl != "kestrel" or args.shape not in MODELS:
            raise SystemExit("--layout runs Kestrel on a bench/matrix.py model (--impl kestrel, --shape one of its models)")
        return cell_step(args.shape, args.method, args.layout)  # graphs auto, or as KESTREL_CUDA_GRAPHS forces them
    if args.shape in SHAPES:
        folder, vocab = shape_dir(args.shape), SHAPES[args.shape]["vocab_size"]
    else:  # a matrix model: its folder as bench/matrix.py builds it (routed experts left out, made on load)
        from bench.matrix_models import build_model_dir

        folder, vocab = build_model_dir(args.shape), MODELS[args.shape]["vocab_size"]
    model = build(args.impl, folder, args)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    ids, labels = random_batch(args.batch, args.seq, vocab)

    def step() -> None:
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if losses is not None:
            losses.append(loss.detach())

    step.model = model  # type: ignore[attr-defined]  # for the step-analysis scripts' hooks
    return step


def warmed_step(args: argparse.Namespace, warmup: int) -> Callable[[], None]:
    """`training_step(args)` after `warmup` steps, the GPU idle (for the step-analysis scripts)."""
    step = training_step(args)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    return step


SPEC_PEAK_TFLOPS = 989.0  # dense bf16, H100 / H200 SXM


def useful_flops_per_token(seq: int, cfg: dict = SHAPES["llama-8b"]) -> float:
    """4N for the frozen base's products plus causal attention (forward + backward) at length `seq`."""
    h, i, L = cfg["hidden_size"], cfg.get("intermediate_size"), cfg["num_hidden_layers"]
    if cfg.get("num_experts_per_tok"):  # a mixture of experts: the k routed experts' products (and a shared expert's)
        i = cfg["num_experts_per_tok"] * (cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        i += cfg.get("shared_expert_intermediate_size") or 0
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    n = L * (h * q + 2 * h * kv + q * h + 3 * h * i) + cfg["vocab_size"] * h
    attention = 3 * L * 2 * q * seq  # forward 2 * q_dim * T per token (T/2 keys, 2 products), x3 with backward
    return 4 * n + attention


def matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    """The bf16 matrix-product rate this GPU reaches now (n x n x n, cuBLAS)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = cuda_time(lambda: a @ b, warmup=5, iters=iters)
    return 2 * n**3 / seconds / 1e12


def _host_rss_gib() -> float:
    """This process's resident host memory (pinned offload buffers included), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _import_first(impl: str) -> str:
    """Import the implementation's package before anything touches CUDA, as its users would:
    Unsloth sets torch's CUDA allocator to expandable segments on import, which only counts
    when torch's allocator has not started yet; a Kestrel run sets its own (`performance.cuda_allocator`)
    before it loads anything. Returns Kestrel's allocator setting ("" for the others)."""
    if impl == "kestrel":
        from kestrel.config import PerformanceSettings
        from kestrel.training.cuda_allocator import apply_cuda_allocator

        return apply_cuda_allocator(PerformanceSettings.cuda_allocator)
    if impl == "unsloth":
        import unsloth  # noqa: F401
    return ""


def measure(args: argparse.Namespace) -> dict:
    """Throughput and memory of args.impl over args.steps steps after args.warmup."""
    _import_first(args.impl)
    if args.memory_cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * (1 << 30) / total))
    shape_dir(args.shape)  # a fresh machine writes the model first: not part of the training's peak
    torch.cuda.reset_peak_memory_stats()
    losses: list[torch.Tensor] = []
    train_step = training_step(args, losses)

    def step() -> None:
        train_step()
        if args.seq * args.batch >= 65536:  # long steps: say how each went (a run may hit its time limit)
            torch.cuda.synchronize()
            print(f"step {len(losses)}: {time.perf_counter() - t0:.1f} s since the model was built, peak "
                  f"{gib(torch.cuda.max_memory_allocated()):.2f} GiB, host RSS {_host_rss_gib():.1f} GiB", flush=True)

    t0 = time.perf_counter()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    warm_peak, warm_reserved = gib(torch.cuda.max_memory_allocated()), gib(torch.cuda.max_memory_reserved())
    torch.cuda.reset_peak_memory_stats()  # the timed steps' own peaks, next to the whole run's
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = args.batch * args.seq * args.steps
    achieved = tokens / elapsed * useful_flops_per_token(args.seq, SHAPES[args.shape]) / 1e12
    steady = gib(torch.cuda.max_memory_allocated()), gib(torch.cuda.max_memory_reserved())  # before the matmul probe
    peak_now = matmul_tflops()
    return {
        "useful_tflops": achieved, "mfu_vs_spec": achieved / SPEC_PEAK_TFLOPS,
        "matmul_tflops_measured": peak_now, "mfu_vs_measured": achieved / peak_now,
        "impl": args.impl, "method": args.method, "batch": args.batch, "seq": args.seq, "steps": args.steps,
        "checkpointing": args.checkpointing, "tokens_per_s": tokens / elapsed, "s_per_step": elapsed / args.steps,
        "peak_gib": max(warm_peak, steady[0]), "reserved_gib": max(warm_reserved, steady[1]),
        "steady_peak_gib": steady[0], "steady_reserved_gib": steady[1],
        "losses": [float(x) for x in losses], "device": torch.cuda.get_device_name(),
        **_graph_stats(args.impl, train_step.model),
    }


def _graph_stats(impl: str, model) -> dict:
    """Kestrel's decoder-layer CUDA graphs: how many were captured, failed, inputs copied, and
    the run's choice for each batch layout."""
    if impl != "kestrel":
        return {}
    from kestrel.recompute.checkpoint import recompute_of

    run = recompute_of(model)
    if run is None:
        return {}
    return {"layer_graphs": run.graphs.stats(), "graph_decisions": [d.as_metrics() for d in run.chooser.decisions()]}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--impls", default="hf,liger,unsloth,kestrel",
                    help="comma-separated; kestrel-eager / kestrel-graphed: Kestrel with CUDA graphs forced off / on")
    ap.add_argument("--anchors", default=str(Path(__file__).resolve().parent.parent / ".gpu-anchors"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--memory-cap-gib", type=float, default=0.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not args.all:
        Path(args.out).write_text(json.dumps(measure(args)))
        return
    shape_dir(args.shape)
    common = ["--method", args.method, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--checkpointing", args.checkpointing,
              "--memory-cap-gib", str(args.memory_cap_gib), "--shape", args.shape]
    results = []
    for impl in args.impls.split(","):
        extra = args.anchors if impl in ("liger", "unsloth") else None
        forced = {"kestrel-eager": "0", "kestrel-graphed": "1"}.get(impl)  # kestrel: its own choice
        env = {"KESTREL_CUDA_GRAPHS": forced} if forced else {}
        res = run_isolated(__file__, ["--impl", impl.split("-")[0], *common], extra_path=extra, env=env)
        res["impl"] = impl
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "losses"}), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("| impl | tokens/s | peak allocated GiB | peak reserved GiB | timed steps' reserved GiB | s/step | MFU (spec) "
          "| MFU (measured peak) |\n|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['impl']} | error | | | | | | |")
        else:
            print(f"| {r['impl']} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.2f} | {r['reserved_gib']:.2f} "
                  f"| {r['steady_reserved_gib']:.2f} "
                  f"| {r['s_per_step']:.3f} | {r['mfu_vs_spec']:.1%} | {r['mfu_vs_measured']:.1%} |")


if __name__ == "__main__":
    main()
