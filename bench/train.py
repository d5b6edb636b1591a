"""Training throughput and peak memory: Kestrel vs HF+PEFT+bitsandbytes vs Liger vs Unsloth.

Each implementation runs in its own process on the same random-init Llama-3.1-8B-shape model,
the same random batch, LoRA r=16 on all 7 linears, AdamW, gradient checkpointing.

    python bench/train.py --all --out results.json                 # every implementation
    python bench/train.py --impl kestrel --out one.json             # one, in this process
    options: --method qlora|lora  --batch 2 --seq 2048 --steps 10 --checkpointing standard|offload

Baselines need their packages on PYTHONPATH: pass --anchors DIR (Unsloth, Liger-Kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import LLAMA_8B, gib, llama8b_dir, random_batch, run_isolated  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _bnb_config():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def _hf_model(folder: Path, args: argparse.Namespace):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=torch.bfloat16, attn_implementation="sdpa", device_map={"": 0})
    if args.method == "qlora":
        kw["quantization_config"] = _bnb_config()
    model = AutoModelForCausalLM.from_pretrained(folder, **kw)
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, bias="none"))


def build(impl: str, folder: Path, args: argparse.Namespace):
    if impl == "hf":
        return _hf_model(folder, args)
    if impl == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
        return _hf_model(folder, args)
    if impl == "unsloth":
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(
            model_name=str(folder), max_seq_length=args.seq, dtype=torch.bfloat16,
            load_in_4bit=args.method == "qlora", local_files_only=True,
        )
        return FastLanguageModel.get_peft_model(
            model, r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, bias="none",
            use_gradient_checkpointing="unsloth" if args.checkpointing == "offload" else True,
        )
    from engine.checkpointing import set_gradient_checkpointing
    from engine.config import LoraSettings
    from engine.loader import load
    from engine.lora import attach_lora

    model, _ = load(str(folder), args.seq, load_in_4bit=args.method == "qlora", dtype="bf16")
    for p in model.parameters():
        p.requires_grad_(False)
    model = attach_lora(model, LoraSettings(r=16, alpha=16, dropout=0.0, targets=TARGETS))
    set_gradient_checkpointing(model, args.checkpointing)
    return model


def measure(impl: str, args: argparse.Namespace) -> dict:
    folder = llama8b_dir()
    torch.cuda.reset_peak_memory_stats()
    model = build(impl, folder, args)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ids, labels = random_batch(args.batch, args.seq, LLAMA_8B["vocab_size"])
    losses = []

    def step() -> None:
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = args.batch * args.seq * args.steps
    return {
        "impl": impl, "method": args.method, "batch": args.batch, "seq": args.seq, "steps": args.steps,
        "checkpointing": args.checkpointing, "tokens_per_s": tokens / elapsed, "s_per_step": elapsed / args.steps,
        "peak_gib": gib(torch.cuda.max_memory_allocated()), "reserved_gib": gib(torch.cuda.max_memory_reserved()),
        "losses": [float(x) for x in losses], "device": torch.cuda.get_device_name(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="kestrel", choices=["kestrel", "hf", "liger", "unsloth"])
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--impls", default="hf,liger,unsloth,kestrel")
    ap.add_argument("--anchors", default=str(Path(__file__).resolve().parent.parent / ".gpu-anchors"))
    ap.add_argument("--method", default="qlora", choices=["qlora", "lora"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--checkpointing", default="standard", choices=["standard", "offload"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not args.all:
        Path(args.out).write_text(json.dumps(measure(args.impl, args)))
        return
    llama8b_dir()
    common = ["--method", args.method, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--checkpointing", args.checkpointing]
    results = []
    for impl in args.impls.split(","):
        extra = args.anchors if impl in ("liger", "unsloth") else None
        res = run_isolated(__file__, ["--impl", impl, *common], extra_path=extra)
        res.setdefault("impl", impl)
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "losses"}), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("| impl | tokens/s | peak GiB | s/step |\n|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['impl']} | error | | |")
        else:
            print(f"| {r['impl']} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.2f} | {r['s_per_step']:.3f} |")


if __name__ == "__main__":
    main()
