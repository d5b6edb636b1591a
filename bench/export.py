"""Export benchmark: a LoRA adapter on the Llama-3.1-8B shape to a q4_k_m GGUF file, timed.

    python bench/export.py --make-only                      # once: base model + adapter (~16 GB on disk)
    python bench/export.py --modes checked --out bench/export.json
    python bench/export.py --modes unchecked --out bench/export.json

Users report about 8 minutes for the same export with Unsloth (merge, convert, quantize; no check).
The model is random-init at the real shape (weights' values do not change speed; no download):
bf16 safetensors in 4 shards, Llama 3.1 RoPE scaling, a Llama-3-style tokenizer trained here and
padded to 128,256 rows. The adapter is random, r=16, alpha 32, on all 7 linears, saved as a
training output folder (adapter/ + config.yaml). Each mode runs in its own process, so its peak
RSS (ru_maxrss) is its own; `checked` includes the Hugging Face reference (fp32, on the GPU) and
the llama.cpp checks of the f16 intermediate and the q4_k_m file, `unchecked` skips the model
comparisons (tokenizer and chat template are still checked). Results are merged into --out (JSON):
wall seconds, seconds per stage, peak RSS and peak GPU memory, the checks' outcomes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5)
SMOKE = dict(SHAPE, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)  # --smoke: the same code path in a minute on a CPU
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    out = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    out.update({"model.norm.weight": (h,), "lm_head.weight": (cfg["vocab_size"], h)})
    return out


def make_model(folder: Path, shape: dict) -> None:
    """Random bf16 weights (N(0, 0.02), norms 1) written shard by shard; config and tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from tests.support.export_fixtures import train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer("llama3", 4000)
    tokenizer.save_pretrained(folder)
    LlamaConfig(**shape, rope_parameters=ROPE, tie_word_embeddings=False, dtype="bfloat16",
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(folder)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(0)
    shapes, weight_map, n = _shapes(shape), {}, 4
    per_shard = sum(torch.Size(s).numel() for s in shapes.values()) // n + 1
    names = list(shapes)
    for idx in range(n):
        shard, size = {}, 0
        while names and (size < per_shard or idx == n - 1):
            name = names.pop(0)
            shape = shapes[name]
            t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen, device=dev) * 0.02
            shard[name] = t.to(torch.bfloat16).cpu()
            size += t.numel()
        fname = f"model-{idx + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, folder / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def make_adapter(run: Path, base: Path, shape: dict, r: int = 16) -> None:
    """A random PEFT LoRA adapter (fp32, as training saves it) in a training output folder."""
    import torch
    import yaml
    from safetensors.torch import save_file

    shapes, gen, tensors = _shapes(shape), torch.Generator().manual_seed(1), {}
    for name, shape in shapes.items():
        if any(f".{t}." in name for t in LINEARS):
            module = "base_model.model." + name.removesuffix(".weight")
            tensors[module + ".lora_A.weight"] = torch.randn(r, shape[1], generator=gen) / shape[1] ** 0.5
            tensors[module + ".lora_B.weight"] = torch.randn(shape[0], r, generator=gen) * 0.01
    (run / "adapter").mkdir(parents=True, exist_ok=True)
    save_file(tensors, run / "adapter" / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0,
              "target_modules": list(LINEARS), "base_model_name_or_path": str(base), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True}
    (run / "adapter" / "adapter_config.json").write_text(json.dumps(config, indent=1))
    (run / "config.yaml").write_text(yaml.safe_dump({"model": str(base), "method": "lora"}))


def run_mode(work: Path, mode: str, quant: str) -> dict:
    """One export in this process; returns times, memory and checks."""
    import torch

    from kestrel.export import export

    stages: dict[str, float] = {}
    start = last = time.perf_counter()
    current = ["start"]

    def progress(fraction: float, message: str) -> None:
        nonlocal last
        now = time.perf_counter()
        stages[current[0]] = stages.get(current[0], 0.0) + now - last
        current[0] = "writing f16 GGUF" if message.startswith("wrote tensor") else message
        last = now

    out = work / f"out-{mode}"
    shutil.rmtree(out, ignore_errors=True)
    result = export(work / "run", "gguf", out, quant=quant, progress=progress, check=mode == "checked")
    wall = time.perf_counter() - start
    gguf = next(out.glob("*.gguf"))
    record = {
        "wall_s": round(wall, 1),
        "stages_s": {k: round(v, 1) for k, v in stages.items()},
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "gguf_gib": round(gguf.stat().st_size / 2**30, 2),
        "passed": result.passed,
        "checks": {k: v for k, v in result.to_dict()["checks"].items()},
        "notes": result.notes,
    }
    shutil.rmtree(out, ignore_errors=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kestrel-export-bench"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "export.json")
    parser.add_argument("--modes", default="checked,unchecked")
    parser.add_argument("--quant", default="q4_k_m")
    parser.add_argument("--make-only", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model of the same vocabulary, for a CPU")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one mode, in a fresh process
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_mode(args.work, args.child, args.quant)))
        return
    base = args.work / "llama-3.1-8b-shape"
    if not (base / "model.safetensors.index.json").is_file():
        t = time.perf_counter()
        shape = SMOKE if args.smoke else SHAPE
        make_model(base, shape)
        make_adapter(args.work / "run", base, shape)
        print(f"made the model and adapter in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    if args.make_only:
        return
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results["machine"] = _machine()
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--work", str(args.work), "--quant", args.quant, "--child", mode]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
        results[f"{mode}_{args.quant}"] = json.loads(done.stdout.strip().splitlines()[-1])
        print(mode, json.dumps(results[f"{mode}_{args.quant}"], indent=1), file=sys.stderr)
    args.out.write_text(json.dumps(results, indent=2))


def _machine() -> dict:
    import llama_cpp
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"gpu": gpu, "cpus": os.cpu_count(), "torch": torch.__version__, "llama_cpp_python": llama_cpp.__version__}


if __name__ == "__main__":
    main()
