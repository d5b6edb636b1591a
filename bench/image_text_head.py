"""An image-text checkpoint trained on text (Gemma 3 4B+, Qwen3.5, Gemma 4 and Mistral 3 ship so): Kestrel's
head on its text calls (`kestrel.model.forwards.make_image_text_forward`: the chunked loss) against Hugging
Face's own image-text forward (the (B, T, V) logits and its loss's fp32 copy of them), everything else as the
product sets it up (`bench.matrix.kestrel_model`: loaded, patched, LoRA, checkpointing auto, graphs auto).

    python bench/image_text_head.py --model gemma3-4b --method qlora --layout packed --out image_text_head.json
    options: --heads kestrel,hf,hf,kestrel (ABBA)  --steps 10  --warmup 12  --batches 16

The language model is `--model`'s matrix shape (bench/model_shapes.py), nested in its family's image-text class
with a one-layer vision tower (`tests.support.tiny_image_text`'s): the head and the stack are the real sizes, the
tower (which text never runs) is not. The folder is built once on the GPU under /tmp. Each run is its own process
(`bench.common.run_isolated`); it reports tokens/s and the peak memory of its timed steps and of the whole run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import mean_by, runs_in_order  # noqa: E402

ROOT = Path("/tmp/kestrel-bench/image-text")


def image_text_type(text_type: str) -> str:
    """The image-text checkpoint type whose language model is of `text_type` (e.g. gemma3_text -> gemma3)."""
    from tests.support.tiny_image_text import IMAGE_TEXT

    for kind, (family, _, _) in IMAGE_TEXT.items():
        if family == text_type:
            return kind
    raise SystemExit(f"no image-text class has a {text_type} language model; pick one of "
                     f"{sorted(f for f, _, _ in IMAGE_TEXT.values())}")


def build_folder(name: str) -> Path:
    """The random-init bf16 image-text folder for matrix shape `name` (built on the GPU once)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from bench.matrix_models import matrix_config, write_model_dir
    from tests.support.tiny_image_text import IMAGE_TEXT

    text = matrix_config(name).to_dict()
    kind = image_text_type(text["model_type"])
    _, vision, extra = IMAGE_TEXT[kind]
    cfg = AutoConfig.for_model(kind, text_config=text, vision_config=vision,
                               tie_word_embeddings=text.get("tie_word_embeddings", False), **extra)
    return write_model_dir(cfg, ROOT / name, "cuda", name, AutoModelForImageTextToText)  # kept once built


def one(args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process with `args.one`'s head."""
    import torch

    from bench.matrix import LAYOUTS, kestrel_model, plan_batches, timed_steps
    from bench.model_shapes import MODELS
    from kestrel.training.heap import steps_heap

    torch.cuda.reset_peak_memory_stats()
    layout = LAYOUTS[args.layout]
    model, flat, recompute = kestrel_model(build_folder(args.model), args.method, layout, "auto")
    outer = model.get_base_model()
    if args.one == "hf":  # HF's own image-text forward: every text call forms the whole vocabulary's logits
        del outer.__dict__["forward"]
    assert ("forward" in outer.__dict__) == (args.one == "kestrel")
    batches = [b.to(torch.device("cuda")) for b in
               plan_batches(args.layout, MODELS[args.model]["vocab_size"], flat, args.batches, 0)]
    with steps_heap():
        res = timed_steps(model, batches, args.warmup, args.steps, getattr(recompute, "chooser", None),
                          len(batches))
    timed = [(args.warmup + res["settle_steps"] + j) % len(batches) for j in range(args.steps)]
    tokens = sum(batches[i].tokens for i in timed)
    return {"head": args.one, "tokens_per_s": tokens / res["elapsed_s"], "s_per_step": res["elapsed_s"] / args.steps,
            "peak_alloc_gib": res["peak_alloc_gib"], "peak_reserved_gib": res["peak_reserved_gib"],
            "steady_alloc_gib": res["steady_alloc_gib"], "steady_reserved_gib": res["steady_reserved_gib"],
            "image_text_class": type(outer).__name__, "device": torch.cuda.get_device_name()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-4b")
    ap.add_argument("--method", default="qlora", choices=["lora", "qlora"])
    ap.add_argument("--layout", default="packed", choices=["padded", "packed", "long"])
    ap.add_argument("--heads", default="kestrel,hf,hf,kestrel")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--one", choices=["kestrel", "hf"], help="(internal) one run in this process")
    ap.add_argument("--out", type=Path, default=Path("image_text_head.json"))
    args = ap.parse_args()
    if args.one:
        args.out.write_text(json.dumps(one(args)))
        return
    passed = ["--model", args.model, "--method", args.method, "--layout", args.layout, "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--batches", str(args.batches)]
    runs = runs_in_order(__file__, passed, args.heads, "head")
    for got in runs:
        print(json.dumps(got)[:600], flush=True)
    means = mean_by(runs, "head", "tokens_per_s")
    if {"kestrel", "hf"} <= means.keys():
        print(f"Kestrel's head / HF's: {means['kestrel'] / means['hf']:.3f}x tokens/s", flush=True)
    args.out.write_text(json.dumps(dict(model=args.model, method=args.method, layout=args.layout, runs=runs,
                                        means=means), indent=1))


if __name__ == "__main__":
    main()
