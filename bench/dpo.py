"""DPO step time, tokens/s and peak GPU memory: Kestrel vs TRL's DPOTrainer vs Unsloth's patched DPO.

Each implementation runs in its own process on the same random-init Llama-3.1-8B-shape model,
QLoRA (NF4, r=16 on all 7 linears), `batch` pairs a step, every chosen and rejected sequence
`seq` tokens long (half prompt, half answer), DPO sigmoid loss, beta 0.1, the reference = the
base with the adapter disabled, gradient checkpointing, AdamW. The issue's target shape is the
default: 2 pairs x 1,024 tokens.

A step's time is the median over the steps after the warm-up ones; tokens/s counts the real
tokens of a step's 2 x batch sequences (prompt + answer) over it; peak memory is
`torch.cuda.max_memory_allocated` over the whole process.

    python bench/dpo.py --out bench/dpo.json                          # kestrel, trl, unsloth
    python bench/dpo.py --impl kestrel --out one.json                 # one, in this process
    python bench/dpo.py --impl kestrel --profile DIR --out one.json   # + 2 profiled steps after the timed
                                                                      # ones (bench/step_profile.py: DIR/profile.txt)
    python bench/dpo.py --impl kestrel --memory-history peak.txt --out one.json  # where the run's memory
                                                                      # peak was set (a slower, untimed run)
    python bench/dpo.py --impls kestrel --eval-split 0.05 --out e.json  # + evaluation at the default interval:
                                                                      # the run's wall time with and without it
    TRITON_INTERPRET=1 python bench/dpo.py --smoke --impls kestrel,trl --out /tmp/s.json   # tiny model on a CPU:
                                                                      # checks the script, times nothing

`--checkpointing` defaults to the product's default (`TrainConfig.gradient_checkpointing`);
`offload` is the mode with the least GPU memory.

TRL, bitsandbytes and datasets must be importable (the `.gpu-site` folder from
../shared/gpu/make-site.sh on PYTHONPATH); Unsloth runs from `--anchors` (its own TRL version).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kestrel.config import TrainConfig  # noqa: E402

from bench.common import (  # noqa: E402
    TARGETS, bench_model_dir, gib, hf_qlora_model, llama8b_dir, run_isolated, step_recorder, trainer_clock,
)

PROMPT_WORDS, CHOSEN_WORDS, REJECTED_WORDS = "apple river stone cloud", "green fast bright warm", "cold slow dark dull"
BETA, LR = 0.1, 5e-6
PROFILED_STEPS = 2  # with --profile: run this many more steps, profiled, after the timed ones


def texts(seq: int, pairs: int) -> list[dict[str, str]]:
    """`pairs` rows whose chosen and rejected sequences are about `seq` tokens of the stand-in
    tokenizer (four words a group; half prompt, half answer)."""
    groups = max(1, seq // 2 // 4)
    fill = lambda words: " ".join([words] * groups)  # noqa: E731
    return [{"prompt": fill(PROMPT_WORDS), "chosen": fill(CHOSEN_WORDS), "rejected": fill(REJECTED_WORDS)}] * pairs


def _medians(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:] or times)


# --- Kestrel ---------------------------------------------------------------------------------

# Where the end-of-run generation check's seconds go: each of these is timed into the timeline.
CHECK_PARTS = (("kestrel.training.recipe", None, "free_training_memory"),
               ("kestrel.decode.generate", "Generator", "__init__"),
               ("kestrel.decode.model", "DecodeModel", "prefill"),
               ("kestrel.decode.generate", "Generator", "_capture"),
               ("kestrel.training.generation_check", "GenerationCheck", "run"))


def time_check_parts(timeline: list[dict[str, Any]]) -> None:
    """Wrap CHECK_PARTS (this process only; the bench's own instrument) so each call adds a
    {"kind": "timed", "text": name, "s": seconds} entry (CUDA synchronised at both ends)."""
    import functools
    import importlib

    began = time.perf_counter()
    for module, cls, name in CHECK_PARTS:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        inner = getattr(owner, name)

        def timed(*a: Any, _inner: Any = inner, _label: str = f"{cls or module}.{name}", **kw: Any) -> Any:
            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            sync()
            t0 = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                sync()
                now = time.perf_counter()
                timeline.append({"t": round(now - began, 3), "kind": "timed", "text": _label, "s": round(now - t0, 3)})

        setattr(owner, name, functools.wraps(inner)(timed))


def run_kestrel(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from kestrel.config import config_from_dict
    from kestrel.training.run import run

    work = Path(tempfile.mkdtemp(prefix="kestrel-dpo-"))
    data = work / "pairs.jsonl"
    profiled = PROFILED_STEPS if args.profile else 0
    pairs = args.batch * (args.steps + profiled + 1)
    pairs = math.ceil(pairs / (1 - args.eval_split))  # the held-out pairs come on top of the trained ones
    data.write_text("".join(json.dumps(r) + "\n" for r in texts(args.seq, pairs)))
    steps: list[dict[str, float]] = []
    decided: list[int] = []  # steps during which the CUDA-graph chooser decided a layout
    timeline: list[dict[str, Any]] = []  # log lines, evaluations and best saves, timed (where the wall time goes)
    callbacks = [step_recorder(steps, decided, timeline)]
    if args.eval_split:
        time_check_parts(timeline)
    if profiled:
        from bench.step_profile import StepProfiler

        callbacks.append(StepProfiler(Path(args.profile), after=args.steps, steps=profiled))
    cfg = config_from_dict(dict(
        model=str(folder), method="dpo", dataset=str(data), output_dir=str(work / "run"), max_seq_length=args.seq + 64,
        batch_size=args.batch, max_steps=args.steps + profiled, learning_rate=LR, save_steps=0, seed=0,
        lr_scheduler="constant", eval_split=args.eval_split, eval_steps=args.eval_steps,
        gradient_checkpointing=args.checkpointing if not args.smoke else "off", dtype="fp32" if args.smoke else "bf16",
        lora={"r": 16, "alpha": 16, "dropout": 0.0, "targets": TARGETS},
        preference={"finetune": "lora" if args.smoke else "qlora", "beta": BETA, "loss_type": "sigmoid"},
    ))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    history = args.memory_history and torch.cuda.is_available()
    if history:  # every allocation from the model's load to the run's end, with its Python stack
        torch.cuda.memory._record_memory_history(max_entries=8_000_000, stacks="python")
    began = time.perf_counter()
    result = run(cfg, callbacks)
    run_wall_s = time.perf_counter() - began
    if history:
        write_history(Path(args.memory_history), steps)
    if result.status != "completed":
        raise RuntimeError(f"kestrel run {result.status}: {result.error}")
    evals = [m for m in steps if "eval_runtime" in m]  # an evaluation reports its own record
    steps = [m for m in steps if "elapsed_s" in m][: args.steps]  # the profiled steps are slower: not timed
    times = [steps[0]["elapsed_s"]] + [b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(steps)]
    settled = max([args.warmup, *(d + 1 for d in decided)])  # past the warm-up and every probe
    return {"step_times": times, "s_per_step": _medians(times, args.warmup),
            "checkpointing": cfg.gradient_checkpointing, "loss_first": steps[0]["loss"],
            "graph_decision_steps": decided, "gc_full_ms": [m.get("gc_full_ms", 0.0) for m in steps],
            "settled_s_per_step": statistics.median(times[settled:]) if settled < len(times) else None,
            "run_wall_s": run_wall_s, **eval_cost(evals, run_wall_s, args.eval_split), "timeline": timeline}


def eval_cost(evals: list[dict[str, float]], run_wall_s: float, split: float) -> dict[str, Any]:
    """With an evaluation set: the evaluations' own time (`eval_runtime` of each evaluation's
    record) and its share of the run's wall time (issue 27: evaluation adds at most 5%; the
    run without evaluation, timed the same way, gives the other side of the comparison)."""
    if not split:
        return {}
    eval_s = sum(m["eval_runtime"] for m in evals)
    return {"eval_split": split, "evaluations": len(evals), "eval_s": eval_s,
            "eval_share": eval_s / run_wall_s if run_wall_s else None}


def write_history(path: Path, steps: list[dict[str, float]]) -> None:
    """The whole run's allocated peak: the step that set it (each step's running `max_alloc_gib`)
    and the blocks alive at that moment by the site that allocated them (`bench/memory_peak.py`)."""
    from bench.memory_peak import peak_report, pools_report

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    running = [m.get("max_alloc_gib", 0.0) for m in steps]
    grew = [i for i, (a, b) in enumerate(itertools.pairwise([0.0, *running])) if b > a]
    lines = [f"running allocated peak by step (GiB): {running}",
             f"steps that raised it: {grew}; the run's peak was set in step {grew[-1] if grew else '?'}",
             "(`allocated at its peak` below counts everything allocated since the model's load)",
             peak_report(snapshot["device_traces"][torch.cuda.current_device()], top=40), pools_report(snapshot)]
    path.write_text("\n".join(lines) + "\n")


# --- TRL and Unsloth (TRL's DPOTrainer, Unsloth patching it) ---------------------------------


def _unsloth_model(folder: Path, args: argparse.Namespace):
    from unsloth import FastLanguageModel, PatchDPOTrainer

    PatchDPOTrainer()
    model, _ = FastLanguageModel.from_pretrained(model_name=str(folder), max_seq_length=args.seq + 64,
                                                 dtype=torch.bfloat16, load_in_4bit=True, local_files_only=True)
    return FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                                            bias="none", use_gradient_checkpointing="unsloth")


def run_trl(args: argparse.Namespace, folder: Path, unsloth: bool) -> dict[str, Any]:
    model = _unsloth_model(folder, args) if unsloth else hf_qlora_model(folder, args.smoke)  # unsloth first: it patches TRL
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(folder)
    stamps: list[float] = []
    rows = texts(args.seq, args.batch * (args.steps + 1))
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                               "chosen": [{"role": "assistant", "content": r["chosen"]}],
                               "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-dpo-"), per_device_train_batch_size=args.batch, max_length=args.seq + 64,
        beta=BETA, loss_type=["sigmoid"], learning_rate=LR, max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", gradient_checkpointing=not args.smoke and not unsloth, bf16=not args.smoke,
        use_cpu=args.smoke and not torch.cuda.is_available(), seed=0,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = DPOTrainer(model=model, ref_model=None, args=config, train_dataset=data, processing_class=tok,
                         callbacks=[trainer_clock(stamps)])
    start = time.perf_counter()
    trainer.train()
    times = [b - a for a, b in itertools.pairwise([start, *stamps])]
    return {"step_times": times, "s_per_step": _medians(times, args.warmup), "checkpointing": "standard"}


# --- driver ----------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    folder = bench_model_dir(args.smoke, args.layers, "dpo-smoke")
    res = run_kestrel(args, folder) if args.impl == "kestrel" else run_trl(args, folder, args.impl == "unsloth")
    cuda = torch.cuda.is_available()
    tokens = 2 * args.batch * args.seq  # chosen and rejected sequences of every pair
    res.update({"impl": args.impl, "pairs": args.batch, "seq": args.seq, "steps": args.steps,
                "tokens_per_s": tokens / res["s_per_step"],
                # What a long run pays on average past the warm-up, probe and capture steps included
                "mean_tokens_per_s": tokens / statistics.fmean(res["step_times"][args.warmup:] or res["step_times"]),
                "peak_gib": gib(torch.cuda.max_memory_allocated()) if cuda else 0.0,
                "reserved_gib": gib(torch.cuda.max_memory_reserved()) if cuda else 0.0,
                "device": torch.cuda.get_device_name() if cuda else "cpu"})
    return res


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| impl | tokens/s | s/step | mean tokens/s | peak GiB | speed vs TRL (median; mean) | peak vs TRL |",
             "|---|---|---|---|---|---|---|"]
    trl = next((r for r in results if r.get("impl") == "trl" and "error" not in r), None)
    for r in results:
        if "error" in r:
            lines.append(f"| {r['impl']} | error: {r['error'].splitlines()[-1][:80]} | | | | | |")
            continue
        speed = (f"{r['tokens_per_s'] / trl['tokens_per_s']:.2f}x; {r['mean_tokens_per_s'] / trl['mean_tokens_per_s']:.2f}x"
                 if trl else "")
        mem = f"{r['peak_gib'] / trl['peak_gib']:.2f}x" if trl and trl["peak_gib"] else ""
        lines.append(f"| {r['impl']} | {r['tokens_per_s']:.0f} | {r['s_per_step']:.3f} | {r['mean_tokens_per_s']:.0f} "
                     f"| {r['peak_gib']:.2f} "
                     f"| {speed} | {mem} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", default="kestrel", choices=["kestrel", "trl", "unsloth"])
    ap.add_argument("--impls", default="kestrel,trl,unsloth")
    ap.add_argument("--batch", type=int, default=2, help="pairs per step")
    ap.add_argument("--seq", type=int, default=1024, help="tokens of each chosen / rejected sequence")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    ap.add_argument("--checkpointing", default=TrainConfig().gradient_checkpointing, choices=["auto", "standard", "offload"],
                    help="Kestrel's gradient_checkpointing (default: the product's default); TRL and Unsloth keep theirs")
    ap.add_argument("--profile", default="", help="kestrel only: profile 2 more steps into this folder (profile.txt)")
    ap.add_argument("--memory-history", default="", help="kestrel only: record the allocator over the whole run and "
                    "write where its peak was set to this file (slows the run: its times are not comparable)")
    ap.add_argument("--eval-split", type=float, default=0.0, help="kestrel only: hold this share of the pairs out and "
                    "evaluate at the default interval (reports eval_s, run_s and eval_share)")
    ap.add_argument("--eval-steps", type=int, default=None, help="with --eval-split: evaluate every N steps "
                    "(default: the product's automatic interval)")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (a quick check of the script)")
    ap.add_argument("--anchors", default=str(Path(__file__).resolve().parent.parent / ".gpu-anchors"))
    ap.add_argument("--smoke", action="store_true", help="tiny model, fp32, no 4-bit: checks the script")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not 0 <= args.eval_split < 0.5:
        ap.error(f"--eval-split is a share of the pairs, from 0 to below 0.5, got {args.eval_split}")
    if args.profile and "--impl" in sys.argv and args.impl != "kestrel":
        ap.error("--profile profiles Kestrel's steps: give it with --impl kestrel (or --impls including kestrel)")
    if "--impl" in sys.argv:  # one implementation, in this process
        Path(args.out).write_text(json.dumps(measure(args)))
        return
    if not args.smoke:
        llama8b_dir(layers=args.layers)  # built once, before the timed processes
    common = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup",
              str(args.warmup), "--checkpointing", args.checkpointing]
    common += (["--layers", str(args.layers)] if args.layers else []) + (["--smoke"] if args.smoke else [])
    results = []
    for impl in args.impls.split(","):
        own = ["--profile", args.profile] if args.profile and impl == "kestrel" else []
        own += ["--memory-history", args.memory_history] if args.memory_history and impl == "kestrel" else []
        own += ["--eval-split", str(args.eval_split)] if args.eval_split and impl == "kestrel" else []
        own += ["--eval-steps", str(args.eval_steps)] if args.eval_steps and impl == "kestrel" else []
        res = run_isolated(__file__, ["--impl", impl, *common, *own],
                           extra_path=args.anchors if impl == "unsloth" else None, timeout=900)
        res.setdefault("impl", impl)
        results.append(res)
        print(json.dumps({**res, "error": res["error"][-400:]} if "error" in res else res), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(_table(results))


if __name__ == "__main__":
    main()
