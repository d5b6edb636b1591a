"""GRPO step time and peak GPU memory: Kestrel vs TRL's GRPOTrainer at the same settings.

Each (implementation, case) runs in its own process on the same random-init Llama-3.1-8B-shape
model, QLoRA (NF4, r=16 on all 7 linears), 8 generations of one prompt per step, beta 0.04,
loss `grpo`, temperature 1, AdamW. Cases:

    rollout   256-token prompt, 1,024-token completions sampled for real (Kestrel: the decode
              path; TRL: transformers `generate`), then the update.
    long      512-token prompt, 16,384-token completions. Sampling that many tokens from a
              random model says nothing new and would take minutes, so both sides get the same
              fixed random completions (TRL through its `rollout_func` hook, Kestrel by
              replacing its rollout function) and the step is the update: reference log-probs,
              policy forward + backward, optimizer step. Unsloth's "loss part" comparison.

A step's time is the median over the steps after the first (which includes warm-up and graph
capture); peak memory is `torch.cuda.max_memory_allocated` over the whole process.

    python bench/grpo.py --out bench/grpo.json                       # everything, ~6-8 minutes
    python bench/grpo.py --impl kestrel --case long --out one.json   # one case in this process
    python bench/grpo.py --smoke --out /tmp/smoke.json               # tiny model, CPU ok, seconds

TRL, bitsandbytes and datasets must be importable (on the GPU machine: the `.gpu-site` folder
from ../shared/gpu/make-site.sh on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import (
    TARGETS, bench_model_dir, gib, hf_qlora_model, llama8b_dir, run_isolated, step_recorder, trainer_clock,
)

WORDS = "apple river stone cloud"  # four tokens of the stand-in tokenizer
CASES = {  # prompt tokens, completion tokens, real sampling?, Kestrel's checkpointing, update rows budget
    "rollout": dict(prompt=256, completion=1024, sample=True, checkpointing="offload", budget=4096),
    "long": dict(prompt=512, completion=16384, sample=False, checkpointing="offload", budget=16384 + 512 + 64),
    "smoke": dict(prompt=16, completion=8, sample=True, checkpointing="off", budget=256),
}
G, BETA, LR = 8, 0.04, 1e-5


def prompt_text(tokens: int) -> str:
    return " ".join([WORDS] * max(1, tokens // 4))


def reward_value(text: str) -> float:
    """The same cheap, varied reward on both sides (its value changes no cost, only advantages)."""
    return float(text.count("a") % 3)


def fixed_completions(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Below 16 and from 128000 up (Llama 3's special tokens) are left out: no row ends early.
    return torch.randint(16, min(vocab, 128000), (rows, length), generator=g).tolist()


# --- Kestrel ---------------------------------------------------------------------------------


def run_kestrel(args: argparse.Namespace, case: dict[str, Any], folder: Path) -> dict[str, Any]:
    from kestrel.config import config_from_dict
    from kestrel.training.grpo import trainer
    from kestrel.training.grpo.rollout import Rollouts
    from kestrel.training.run import run

    work = Path(tempfile.mkdtemp(prefix="kestrel-grpo-"))
    data = work / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": prompt_text(case["prompt"])}) + "\n")
    if not case["sample"]:
        def fixed_rollout(generator, tokenizer, prompts, num_generations, max_new_tokens, *rest, **kw):
            rows = [list(p) for p in prompts for _ in range(num_generations)]
            comps = fixed_completions(len(rows), max_new_tokens, generator.backend.vocab_size, seed=len(rows))
            texts = ["a" * (i % 3) for i in range(len(rows))]
            return Rollouts(rows, comps, texts, [False] * len(rows))

        trainer.rollout = fixed_rollout
    steps: list[dict[str, float]] = []
    cfg = config_from_dict(dict(
        model=str(folder), method="grpo", dataset=str(data), output_dir=str(work / "run"),
        max_seq_length=case["budget"],
        batch_size=1, max_steps=args.steps, learning_rate=LR, save_steps=0, seed=0, lr_scheduler="constant",
        gradient_checkpointing=case["checkpointing"], lora={"r": 16, "alpha": 16, "dropout": 0.0, "targets": TARGETS},
        grpo=dict(num_generations=G, max_completion_length=case["completion"], max_prompt_length=case["prompt"] + 64,
                  beta=BETA, loss_type="grpo", temperature=1.0, rewards=[{"name": "format_regex", "pattern": "a"}]),
    ))
    cfg.grpo.load_in_4bit = not args.smoke  # GrpoSettings.load_in_4bit (proposed); read when present
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = run(cfg, [step_recorder(steps)])
    if result.status != "completed":
        raise RuntimeError(f"kestrel run {result.status}: {result.error}")
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(steps)]
    return {
        "step_times": [steps[0]["elapsed_s"], *times],
        "s_per_step": statistics.median(times or [steps[0]["elapsed_s"]]),
        "rollout_s": statistics.median([m["rollout_s"] for m in steps[1:]] or [steps[0]["rollout_s"]]),
        "update_s": statistics.median([m["update_s"] for m in steps[1:]] or [steps[0]["update_s"]]),
        "completion_len_mean": statistics.mean(m["completion_len_mean"] for m in steps),
        "checkpointing": case["checkpointing"], "rows_per_forward_budget_tokens": case["budget"],
    }


# --- TRL -------------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace, case: dict[str, Any], folder: Path) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(folder)
    model = hf_qlora_model(folder, args.smoke, checkpointing=True)
    vocab = model.get_base_model().lm_head.weight.shape[0]
    stamps: list[float] = []
    lengths: list[int] = []

    def reward(completions: list[str], **kw: Any) -> list[float]:
        return [reward_value(c) for c in completions]

    def fixed(prompts: list[str], trainer: Any) -> dict[str, Any]:
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": fixed_completions(len(ids), case["completion"], vocab, len(ids)),
                "logprobs": None}

    class Lengths(TrainerCallback):
        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **k: Any) -> None:
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    out = Path(tempfile.mkdtemp(prefix="trl-grpo-"))
    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=G, num_generations=G, max_completion_length=case["completion"],
        beta=BETA, loss_type="grpo", temperature=1.0, learning_rate=LR, max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to="none", gradient_checkpointing=True, bf16=not args.smoke,
        use_cpu=args.smoke and not torch.cuda.is_available(), seed=0, log_completions=False,
    )
    data = Dataset.from_dict({"prompt": [prompt_text(case["prompt"])] * (G * args.steps)})
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok,
                          callbacks=[trainer_clock(stamps), Lengths()], rollout_func=None if case["sample"] else fixed)
    start = time.perf_counter()
    trainer.train()
    edges = [start, *stamps]
    times = [b - a for a, b in itertools.pairwise(edges)]
    return {"step_times": times, "s_per_step": statistics.median(times[1:] or times),
            "completion_len_mean": statistics.mean(lengths) if lengths else None, "checkpointing": "standard"}


# --- driver ----------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    case = CASES["smoke" if args.smoke and args.case == "rollout" else args.case]
    if args.smoke and args.case == "long":
        case = dict(case, completion=32, sample=False, budget=128)
    folder = bench_model_dir(args.smoke, args.layers, "grpo-smoke")
    res = (run_kestrel if args.impl == "kestrel" else run_trl)(args, case, folder)
    cuda = torch.cuda.is_available()
    res.update({
        "impl": args.impl, "case": args.case, "prompt_tokens": case["prompt"], "completion_tokens": case["completion"],
        "num_generations": G, "steps": args.steps, "sampled": case["sample"],
        "peak_gib": gib(torch.cuda.max_memory_allocated()) if cuda else 0.0,
        "reserved_gib": gib(torch.cuda.max_memory_reserved()) if cuda else 0.0,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    })
    return res


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| case | impl | s/step | peak GiB | peak vs TRL | step time vs TRL |", "|---|---|---|---|---|---|"]
    by = {(r["case"], r["impl"]): r for r in results}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['impl']} | error: {r['error'].splitlines()[-1][:80]} | | | |")
            continue
        trl = by.get((r["case"], "trl"), {})
        ok = "error" not in trl and trl
        mem = f"{r['peak_gib'] / trl['peak_gib']:.2f}x" if ok and trl["peak_gib"] else ""
        step = f"{r['s_per_step'] / trl['s_per_step']:.2f}x" if ok else ""
        lines.append(f"| {r['case']} | {r['impl']} | {r['s_per_step']:.2f} | {r['peak_gib']:.2f} | {mem} | {step} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", default="kestrel", choices=["kestrel", "trl"])
    ap.add_argument("--case", default="rollout", choices=["rollout", "long"])
    ap.add_argument("--cases", default="rollout,long")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per run; the first is warm-up")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (a quick check of the script)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, short lengths, no 4-bit: checks the script")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if "--impl" in sys.argv:  # one case, in this process
        Path(args.out).write_text(json.dumps(measure(args)))
        return
    if not args.smoke:
        llama8b_dir(layers=args.layers)  # built once, before the timed processes
    common = ["--steps", str(args.steps)] + (["--layers", str(args.layers)] if args.layers else [])
    common += ["--smoke"] if args.smoke else []
    results = []
    for case in args.cases.split(","):
        for impl in ("kestrel", "trl"):
            res = run_isolated(__file__, ["--impl", impl, "--case", case, *common], timeout=600)
            res.setdefault("impl", impl)
            res.setdefault("case", case)
            results.append(res)
            shown = {**res, "error": res["error"][-400:]} if "error" in res else res
            print(json.dumps(shown), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(_table(results))


if __name__ == "__main__":
    main()
