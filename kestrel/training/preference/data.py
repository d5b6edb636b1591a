"""A preference run's data: the dataset read and tokenized once, with a report of what was
skipped, and the order of micro-batches (reproducible from the seed, so a resumed run continues
where it stopped).

    data = prepare_samples(config, tokenizer, cb)          # data.train, data.held (evaluation)
    idx = micro_batch(len(samples), config.batch_size, config.seed, m)   # rows of micro-batch m
    partner = kl_partners(len(samples), config.seed)                      # KTO's mismatched answers
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Any

from kestrel.config import TrainConfig
from kestrel.data.preference import PreferenceRow, load_preferences
from kestrel.data.preference_tokens import PreferenceSample, tokenize_preferences
from kestrel.data.reader import RowIssue
from kestrel.errors import DatasetError
from kestrel.training.evaluation import split_for_eval
from kestrel.training.metrics import Callback

UNPAIRED = ("kto",)


def data_kind(method: str) -> str:
    """unpaired rows for KTO, paired (chosen, rejected) for DPO, ORPO and SimPO."""
    return "unpaired" if method in UNPAIRED else "paired"


@dataclass
class PreparedData:
    """The rows a run trains on, and those it evaluates on (held out of `dataset` by `eval_split`,
    or read from `eval_dataset`; empty without an evaluation set). `held_rows` are the held-out
    rows as messages, in `held`'s order (the generation check shows their prompts and answers)."""

    train: list[PreferenceSample]
    held: list[PreferenceSample] = field(default_factory=list)
    held_rows: list[PreferenceRow] = field(default_factory=list)


def _report_skipped(bad: list[RowIssue]) -> str | None:
    """One log line naming the first skipped rows and why (None when none were)."""
    if not bad:
        return None
    bad = sorted(bad, key=lambda issue: issue.line)
    return ("skipped rows: " + "; ".join(f"line {b.line}: {b.reason}" for b in bad[:5])
            + (f"; and {len(bad) - 5} more" if len(bad) > 5 else ""))


def _tokenize(config: TrainConfig, tokenizer: Any, rows: list[PreferenceRow], bad: list[RowIssue], source: str,
              header: str, cb: Callback) -> list[PreferenceSample]:
    """Token ids of `rows` (chat template applied, answers cut to max_seq_length), reported
    after `header` (what the file holds)."""
    samples, report = tokenize_preferences(tokenizer, rows, config.max_seq_length)
    skipped = bad + report.skipped
    cb.on_log(f"{header}, {len(samples)} rows used, {len(skipped)} rows skipped")
    if (line := _report_skipped(skipped)) is not None:
        cb.on_log(line)
    if report.truncated:
        cb.on_log(f"{source}: {report.truncated} rows had answers cut to fit max_seq_length={config.max_seq_length}")
    if not samples:
        raise DatasetError(f"{source}: no row fits max_seq_length={config.max_seq_length}; raise it")
    return samples


def _load(path: str, config: TrainConfig) -> tuple[list[PreferenceRow], list[RowIssue], str]:
    data = load_preferences(path, data_kind(config.method), config.columns, config.system_prompt)
    return data.rows, data.bad, data.layout


def prepare_samples(config: TrainConfig, tokenizer: Any, cb: Callback) -> PreparedData:
    """The dataset read (its layout detected), `eval_split` of its rows held out (seeded, before
    tokenizing: no row is in both), or the rows of `eval_dataset` (any layout `dataset` accepts),
    tokenized with the chat template and reported: rows used, rows skipped with their lines and
    reasons, answers cut at max_seq_length."""
    kind = data_kind(config.method)
    rows, bad, layout = _load(config.dataset, config)
    held_rows: list[PreferenceRow] = []
    held_bad: list[RowIssue] = []
    held_header = f"eval_split of dataset {config.dataset}"
    if config.eval_split > 0:
        rows, held_rows = split_for_eval(config, rows, "rows", cb)
    elif config.eval_dataset:
        held_rows, held_bad, held_layout = _load(config.eval_dataset, config)
        held_header = f"eval_dataset {config.eval_dataset}: {kind} preference data ({held_layout} layout)"
    train = _tokenize(config, tokenizer, rows, bad, f"dataset {config.dataset}",
                      f"dataset {config.dataset}: {kind} preference data ({layout} layout)", cb)
    if kind == "unpaired":
        desirable = sum(bool(s.label) for s in train)
        cb.on_log(f"KTO labels: {desirable} desirable, {len(train) - desirable} undesirable")
    if not held_rows:
        return PreparedData(train)
    held = _tokenize(config, tokenizer, held_rows, held_bad, f"eval set {config.eval_dataset or config.dataset}",
                     held_header, cb)
    kept = {s.line for s in held}
    return PreparedData(train, held, [r for r in held_rows if r.line in kept])


def per_epoch(n: int, batch_size: int) -> int:
    """Micro-batches in an epoch (a last partial one is dropped, as SFT's plan does)."""
    return max(1, n // batch_size)


@functools.lru_cache(maxsize=4)
def _order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return tuple(order)


def micro_batch(n: int, batch_size: int, seed: int, m: int) -> list[int]:
    """The sample indices of micro-batch `m` of the run (epoch after epoch, each reshuffled)."""
    epoch, k = divmod(m, per_epoch(n, batch_size))
    order = _order(n, seed, epoch)
    chosen = list(order[k * batch_size : (k + 1) * batch_size])
    return chosen or list(order[:batch_size])


def kl_partners(n: int, seed: int) -> list[int]:
    """For each sample, another sample whose answer it is paired with for KTO's KL estimate (a
    shuffled cycle, so no sample is its own partner when n > 1 and each answer is used once)."""
    order = list(range(n))
    random.Random(seed + 1).shuffle(order)
    partner = [0] * n
    for k, i in enumerate(order):
        partner[i] = order[(k + 1) % n]
    return partner
