"""A preference run's data: the dataset read and tokenized once, with a report of what was
skipped, and the order of micro-batches (reproducible from the seed, so a resumed run continues
where it stopped).

    samples = prepare_samples(config, tokenizer, cb)
    idx = micro_batch(len(samples), config.batch_size, config.seed, m)   # rows of micro-batch m
    partner = kl_partners(len(samples), config.seed)                      # KTO's mismatched answers
"""

from __future__ import annotations

import functools
import random
from typing import Any

from kestrel.config import TrainConfig
from kestrel.data.preference import load_preferences
from kestrel.data.preference_tokens import PreferenceSample, tokenize_preferences
from kestrel.errors import DatasetError
from kestrel.training.metrics import Callback

UNPAIRED = ("kto",)


def data_kind(method: str) -> str:
    """unpaired rows for KTO, paired (chosen, rejected) for DPO, ORPO and SimPO."""
    return "unpaired" if method in UNPAIRED else "paired"


def prepare_samples(config: TrainConfig, tokenizer: Any, cb: Callback) -> list[PreferenceSample]:
    """The dataset read (its layout detected), tokenized with the chat template, and reported:
    rows used, rows skipped with their lines and reasons, answers cut at max_seq_length."""
    kind = data_kind(config.method)
    data = load_preferences(config.dataset, kind, config.columns, config.system_prompt)
    samples, report = tokenize_preferences(tokenizer, data.rows, config.max_seq_length)
    bad = sorted(data.bad + report.skipped, key=lambda issue: issue.line)
    cb.on_log(f"dataset {config.dataset}: {kind} preference data ({data.layout} layout), {len(samples)} rows used, "
              f"{len(bad)} rows skipped")
    if bad:
        cb.on_log("skipped rows: " + "; ".join(f"line {b.line}: {b.reason}" for b in bad[:5])
                  + (f"; and {len(bad) - 5} more" if len(bad) > 5 else ""))
    if report.truncated:
        cb.on_log(f"{report.truncated} rows had answers cut to fit max_seq_length={config.max_seq_length}")
    if not samples:
        raise DatasetError(f"{config.dataset}: no row fits max_seq_length={config.max_seq_length}; raise it")
    if kind == "unpaired":
        desirable = sum(bool(s.label) for s in samples)
        cb.on_log(f"KTO labels: {desirable} desirable, {len(samples) - desirable} undesirable")
    return samples


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
