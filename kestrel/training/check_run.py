"""The generation check on demand: a finished run's held-out prompts answered greedily by saved
weights (its best, final or a checkpoint's) through the fast decode path, scored against their
reference answers, written to RUN/generation_check.json (the file the end-of-run check writes).

    python -m kestrel.training.check_run RUN_DIR --weights RUN_DIR/best --step 30

`--weights` is a folder holding adapter/ (LoRA, on the run's base model) or model/ (a full
fine-tune). The held-out rows are found again from RUN_DIR/config.yaml as training found them:
the same seeded eval_split of `dataset`, or `eval_dataset`. The studio runs this in a process of
its own, so a crash in native code (a CUDA kernel, the decode path) ends this process only; the
exit status is 0 when the file is written, 2 for a run that cannot be checked (the reason on
stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kestrel.config import TrainConfig, load_config
from kestrel.errors import KestrelError
from kestrel.training.generation_check import GENERATION_PROMPTS, MAX_NEW_TOKENS, GenerationCase, GenerationCheck
from kestrel.training.metrics import Callback

CANNOT_CHECK = 2


def _sft_check(config: TrainConfig, tokenizer: Any) -> GenerationCheck:
    from kestrel.data import load_conversations
    from kestrel.training.sft_eval import held_out

    _, convs, _ = load_conversations(config.dataset, config.dataset_format, config.columns, config.system_prompt)
    _, held = held_out(config, convs, Callback())
    return GenerationCheck.from_conversations(held, tokenizer, config.max_seq_length)


def _preference_check(config: TrainConfig, tokenizer: Any) -> GenerationCheck:
    from kestrel.training.preference.data import prepare_samples
    from kestrel.training.preference.evaluation import generation_cases

    data = prepare_samples(config, tokenizer, Callback())
    return GenerationCheck.sized(generation_cases(data.held_rows, data.held), tokenizer)


def _grpo_check(config: TrainConfig, tokenizer: Any) -> GenerationCheck:
    from kestrel.training.grpo.data import load_prompts
    from kestrel.training.grpo.evaluation import held_out_prompts
    from kestrel.training.grpo.rewards import needs_answers

    answers = needs_answers(config.grpo.rewards)
    prompts, _, _ = load_prompts(config, tokenizer, answers)
    _, held = held_out_prompts(config, prompts, tokenizer, answers, Callback())
    cases = [GenerationCase(r.ids, r.text, r.answer, r.line) for r in held if r.answer]
    return GenerationCheck(cases[:GENERATION_PROMPTS], config.grpo.max_completion_length)


def held_out_check(config: TrainConfig, tokenizer: Any) -> GenerationCheck:
    """The run's held-out prompts with their references (as its end-of-run check had them)."""
    if not (config.eval_split > 0 or config.eval_dataset):
        raise KestrelError(f"run {config.output_dir} has no evaluation set (eval_split or eval_dataset), so no "
                           "held-out prompts to check; train with eval_split: 0.05 (or an eval_dataset file)")
    make = _grpo_check if config.method == "grpo" else _preference_check if config.is_preference else _sft_check
    check = make(config, tokenizer)
    if not check.cases:
        raise KestrelError(f"run {config.output_dir}: none of its held-out rows has a reference answer to compare "
                           "with (rows of raw text, or GRPO prompts without an answer column)")
    return check


def load_weights(config: TrainConfig, folder: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of the weights in `folder` (adapter/ on the run's base, or model/)."""
    from kestrel.decode.adapters import load_adapter
    from kestrel.model.loader import load

    length = max(config.max_seq_length, config.grpo.max_prompt_length) + MAX_NEW_TOKENS
    if (folder / "adapter" / "adapter_config.json").is_file():
        model, tokenizer = load(config.model, length, patch=False)
        return load_adapter(model, folder / "adapter", "default"), tokenizer
    if (folder / "model" / "config.json").is_file():
        return load(str(folder / "model"), length, patch=False)
    raise KestrelError(f"{folder} holds no adapter/ or model/ weights")


def check_run(run_dir: Path, weights: Path, step: int) -> dict[str, Any]:
    """Answer the held-out prompts of the run in `run_dir` with `weights`; returns what was written."""
    config = load_config(run_dir / "config.yaml")
    model, tokenizer = load_weights(config, weights)
    return held_out_check(config, tokenizer).run(model, tokenizer, run_dir, step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kestrel.training.check_run", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run's output folder (with config.yaml)")
    parser.add_argument("--weights", type=Path, required=True, help="a folder holding adapter/ or model/")
    parser.add_argument("--step", type=int, required=True, help="the training step of those weights")
    args = parser.parse_args(argv)
    try:
        summary = check_run(args.run_dir, args.weights, args.step)
    except KestrelError as exc:
        print(exc, file=sys.stderr)
        return CANNOT_CHECK
    print(f"{len(summary['rows'])} prompts: exact match {summary['exact_match']:.0%}, ROUGE-L {summary['rouge_l']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
