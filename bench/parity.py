"""Kestrel against HF+PEFT on the GPU at a real shape, with an adapter that is not zero.

A fresh adapter has B = 0, so a first loss says nothing about how the adapter enters the forward.
Here every implementation (each in its own process, on the same random-init model and batch) gets
the same seeded A and B (B nonzero), and reports:
- the training loss with B set, its adapter gradients (compared tensor by tensor with HF's), and
  the no-grad loss (a checkpoint's first pass takes other branches than a forward that saves);
- the decoder layers' outputs under no grad (the first layer where they part is where to look);
- from the same A and B = 0, the losses of `--steps` AdamW steps (lr 1e-4), as bench/train.py.

    python bench/parity.py --shape llama-8b --layers 2 --out parity.json
    options: --method qlora|lora  --cases hf,hf32,kestrel,kestrel:torch,kestrel:-mlp-attention
             (hf32: HF+PEFT in fp32, NF4 dequantized to fp32, the reference for rounding;
              kestrel:torch: KESTREL_KERNELS=torch; kestrel:-a-b: PatchFlags a and b off)
- `update_scan`: the loss with the first step's B scaled by c = 0, 1, 3, 10, 30: how much of a
  step the forward shows (bench/RESULTS.md, QLoRA "Session 13").
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import SHAPES, random_batch, run_isolated, shape_dir  # noqa: E402
from bench.train import TARGETS, hf_model  # noqa: E402


def _short(name: str) -> str:
    """A parameter's name from `layers.` on: the same in every implementation's PEFT wrapping."""
    return name[name.index("layers."):] if "layers." in name else name


def _set_adapters(model: torch.nn.Module, b_std: float) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's bound), B ~ N(0, b_std^2); seeded by name."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." not in name and ".lora_B." not in name:
                continue
            gen = torch.Generator().manual_seed(zlib.crc32(_short(name).encode()))
            if ".lora_A." in name:
                v = (torch.rand(p.shape, generator=gen) * 2 - 1) / p.shape[1] ** 0.5
            else:
                v = torch.randn(p.shape, generator=gen) * b_std
            p.copy_(v.to(p.device, p.dtype))


def _kestrel(folder: Path, args: argparse.Namespace, off: list[str]):
    from kestrel.recompute.checkpoint import set_gradient_checkpointing
    from kestrel.config import LoraSettings
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora
    from kestrel.model.patching import PatchFlags

    flags = PatchFlags(**{name: False for name in off})
    model, _ = load(str(folder), args.seq, load_in_4bit=args.method == "qlora", dtype="bf16", patch=flags)
    for p in model.parameters():
        p.requires_grad_(False)
    model = attach_lora(model, LoraSettings(r=16, alpha=16, dropout=0.0, targets=TARGETS))
    set_gradient_checkpointing(model, args.checkpointing)
    return model


def _layer_outputs(model: torch.nn.Module, run) -> tuple[list[torch.Tensor], float]:
    """Each decoder layer's output (first row, first 512 positions, fp32 on the CPU) in `run()`,
    and the loss `run()` returns."""
    found = [m for name, m in model.named_modules() if name.split(".")[-2:-1] == ["layers"]]
    seen: list[torch.Tensor] = []

    def hook(_m, _i, out) -> None:
        h = out[0] if isinstance(out, tuple) else out
        seen.append(h[0, :512].detach().float().cpu())

    handles = [m.register_forward_hook(hook) for m in found]
    try:
        loss = run()
    finally:
        for h in handles:
            h.remove()
    return seen, float(loss)


def _update_scan(forward, trainable: list) -> dict[str, float]:
    """Loss (no grad) with the first step's B scaled by c (A as it is): how much of the update's
    effect the forward shows. Faithful forwards fall about linearly in c for small c."""
    bs = [(p, p.detach().clone()) for n, p in trainable if ".lora_B." in n]
    out = {}
    with torch.no_grad():
        for c in (0.0, 1.0, 3.0, 10.0, 30.0):
            for p, b in bs:
                p.copy_(b * c)
            out[str(c)] = float(forward())
        for p, b in bs:
            p.copy_(b)
    return out


def _with_b(model: torch.nn.Module, forward, trainable: list, b_std: float) -> tuple[dict, dict]:
    """With the seeded A and B ~ N(0, b_std^2): the training loss and its adapter gradients, the
    no-grad loss and the decoder layers' outputs."""
    _set_adapters(model, b_std)
    loss = forward()
    loss.backward()
    grads = {_short(n): p.grad.float().cpu() for n, p in trainable}
    for _, p in trainable:
        p.grad = None
    with torch.no_grad():
        hidden, loss_nograd = _layer_outputs(model, forward)
    return {"loss_b": loss.item(), "loss_b_nograd": loss_nograd}, {"grads": grads, "hidden": hidden}


def _trajectory(model: torch.nn.Module, forward, trainable: list, steps: int) -> dict:
    """From the seeded A and B = 0: `steps` AdamW steps (lr 1e-4, as bench/train.py), the first
    step's gradient and update sizes (two of the projections), and `_update_scan` after it."""
    _set_adapters(model, 0.0)
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-4, fused=True)
    losses, first, scan = [], {}, {}
    shown = [n for n, _ in trainable if _short(n).startswith(("layers.0.self_attn.q_proj", "layers.0.mlp.down"))]
    for step in range(steps):
        step_loss = forward()
        step_loss.backward()
        if step == 0:
            before = {n: p.detach().float().clone() for n, p in trainable if n in shown}
            first = {_short(n): {"grad_abs_mean": float(p.grad.float().abs().mean())} for n, p in trainable if n in shown}
        opt.step()
        if step == 0:
            for n, p in trainable:
                if n in shown:
                    first[_short(n)]["update_abs_mean"] = float((p.detach().float() - before[n]).abs().mean())
            scan = _update_scan(forward, trainable)
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss.item())
    return {"loss_zero_b": losses[0] if losses else None, "trajectory": losses, "first_step": first, "update_scan": scan}


def child(args: argparse.Namespace) -> dict:
    folder = shape_dir(args.shape, layers=args.layers)
    impl, _, variant = args.case.partition(":")
    off = [v for v in variant.split("-") if v] if variant.startswith("-") else []
    if impl in ("hf", "hf32"):
        model = hf_model(folder, args, torch.float32 if impl == "hf32" else torch.bfloat16)
    else:
        model = _kestrel(folder, args, off)
    model.train()
    ids, labels = random_batch(args.batch, args.seq, SHAPES[args.shape]["vocab_size"])
    forward = lambda: model(input_ids=ids, labels=labels, use_cache=False).loss  # noqa: E731
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    losses, dumped = _with_b(model, forward, trainable, args.b_std)
    torch.save(dumped, args.dump)
    return {"case": args.case, "trainable": len(trainable), **losses,
            **_trajectory(model, forward, trainable, args.steps)}


def _compare(ref: dict, got: dict) -> dict:
    """Worst relative error (|a - b| / |a|, norms) and lowest cosine over the adapter gradients,
    and per-layer relative error of the decoder outputs."""
    rel, cos, worst = 0.0, 1.0, ""
    for name, g in ref["grads"].items():
        h = got["grads"].get(name)
        if h is None:
            return {"missing": name}
        r = float((h - g).norm() / g.norm().clamp_min(1e-30))
        c = float(torch.nn.functional.cosine_similarity(h.flatten(), g.flatten(), dim=0))
        if r > rel:
            rel, worst = r, name
        cos = min(cos, c)
    layers = [float((b - a).norm() / a.norm()) for a, b in zip(ref["hidden"], got["hidden"])]
    return {"grad_rel_max": rel, "grad_rel_worst": worst, "grad_cos_min": cos, "layer_rel": layers,
            "layers_seen": [len(ref["hidden"]), len(got["hidden"])]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="")
    ap.add_argument("--cases", default="hf,hf32,kestrel")
    ap.add_argument("--method", default="qlora")
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--checkpointing", default="standard")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--b-std", type=float, default=0.01)
    ap.add_argument("--dump", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.case:
        Path(args.out).write_text(json.dumps(child(args)))
        return
    shape_dir(args.shape, layers=args.layers)
    common = ["--method", args.method, "--shape", args.shape, "--layers", str(args.layers), "--batch", str(args.batch),
              "--seq", str(args.seq), "--checkpointing", args.checkpointing, "--steps", str(args.steps),
              "--b-std", str(args.b_std)]
    results, dumps = [], {}
    for i, case in enumerate(args.cases.split(",")):
        dump = f"/tmp/kestrel-bench/parity-{i}.pt"
        env = {"KESTREL_KERNELS": "torch"} if case.endswith(":torch") else {}
        res = run_isolated(__file__, ["--case", case, "--dump", dump, *common], env=env)
        res["case"] = case
        if "error" not in res:
            dumps[case] = torch.load(dump)
            if case != "hf" and "hf" in dumps:
                res.update(_compare(dumps["hf"], dumps[case]))
        results.append(res)
        print(json.dumps(res), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
