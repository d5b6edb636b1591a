"""GRPO rewards: verifiable built-ins, a weighted sum, and custom rewards from a Python file.

    rewards = RewardSet(config.grpo.rewards, allow_custom=config.grpo.allow_custom_rewards)
    total, parts = rewards(RewardBatch(prompts, completions, answers, lengths))
    # total (N,) = sum_k weight_k * parts[key_k] (N,)

Built-ins (`RewardSpec.name`):
    exact_answer    1 when the completion's answer equals the row's `answer`, else 0. The answer is
                    the last `<answer>...</answer>` tag, else the last `\\boxed{...}`, else the text
                    after a `####` marker, else the final number; numbers compare by value
                    ("1,234" == "1234.0", "\\frac{1}{2}" == "0.5"), other text case-insensitively.
    format_regex    1 when `re.search(pattern, completion)` matches (DOTALL: `.` spans lines;
                    anchor with ^ and $ to require the whole completion), else 0.
    length_penalty  0 up to `target_length` completion tokens, then -(len - target) / target,
                    floored at -1.
    json_valid      1 when the completion (or its first ``` fenced block) parses as a JSON object
                    or array, else 0.
    custom          `reward(prompts, completions, answers) -> list[float]` from the Python file at
                    `path`, imported with importlib. Only with `grpo.allow_custom_rewards: true`:
                    the file runs inside the training process with the user's permissions.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from kestrel.config import RewardSpec, custom_reward_refusal
from kestrel.constants import REWARD_NAMES
from kestrel.errors import ConfigError, KestrelError

BUILTINS = REWARD_NAMES


class RewardError(KestrelError):
    """A reward function that failed or returned something unusable during training."""


@dataclass
class RewardBatch:
    """One step's completions, row-aligned: N rows (prompts and answers repeated per generation)."""

    prompts: list[str]
    completions: list[str]
    answers: list[str | None]
    lengths: list[int]  # completion tokens per row


RewardFn = Callable[[RewardBatch], list[float]]

# --- answer extraction --------------------------------------------------------------------------

# A number: optional sign (not when glued to a preceding digit, so "5-3" gives 5 and 3),
# thousands separators, decimals, an optional "/denominator".
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|(?<![\w.])[-+]?\.\d+")
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASHES = re.compile(r"####\s*(.+)")
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces matched), None when there is none."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j]
        start = text.rfind("\\boxed{", 0, start)  # unclosed: try an earlier one
    return None


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text.replace("\u2212", "-"))
    return found[-1] if found else None


def parse_number(text: str) -> Fraction | None:
    """"1,234" / "-0.50" / "$12" / "3/4" / "\\frac{3}{4}" / "50%" -> an exact Fraction, else None."""
    s = text.strip().replace("\u2212", "-").replace("\\$", "").strip("$ ").rstrip(".").replace("\\%", "%")
    s = s.rstrip("%").replace(",", "").strip()
    frac = _FRAC.match(s)
    if frac:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        return num / den if num is not None and den else None
    try:
        return Fraction(s) if s and s[-1].isdigit() else None
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> str | None:
    """The answer a text gives: `<answer>` tag > `\\boxed{}` > `#### x` > final number > the text."""
    tags = _TAG.findall(text)
    if tags:
        inner = tags[-1]
        return last_boxed(inner) or inner.strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    number = last_number(text)
    if number is not None:
        return number
    return text.strip() or None


def _as_value(answer: str) -> Fraction | str:
    """A number when the answer is or ends in one, else normalised text."""
    value = parse_number(answer)
    if value is None and (number := last_number(answer)) is not None:
        value = parse_number(number)
    return value if value is not None else " ".join(answer.casefold().split()).rstrip(".")


def answers_match(completion: str, reference: str) -> bool:
    """True when the completion's extracted answer equals the reference's (see the module doc)."""
    got, want = extract_answer(completion), extract_answer(reference)
    if got is None or want is None:
        return False
    return _as_value(got) == _as_value(want)


# --- built-in rewards -----------------------------------------------------------------------------


def exact_answer(batch: RewardBatch) -> list[float]:
    return [float(a is not None and answers_match(c, a)) for c, a in zip(batch.completions, batch.answers)]


def format_regex(pattern: str) -> RewardFn:
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ConfigError(f"grpo.rewards format_regex: pattern {pattern!r} is not a valid regex ({exc})") from exc
    return lambda batch: [float(compiled.search(c) is not None) for c in batch.completions]


def length_penalty(target: int) -> RewardFn:
    return lambda batch: [-min(1.0, max(0, n - target) / target) for n in batch.lengths]


_FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


def _is_json(text: str) -> bool:
    fenced = _FENCE.search(text)
    body = (fenced.group(1) if fenced else text).strip()
    try:
        return isinstance(json.loads(body), (dict, list))
    except ValueError:  # json.JSONDecodeError is a ValueError
        return False


def json_valid(batch: RewardBatch) -> list[float]:
    return [float(_is_json(c)) for c in batch.completions]


# --- custom rewards -------------------------------------------------------------------------------


def load_custom_reward(path: str | None, allowed: bool) -> RewardFn:
    """`reward(prompts, completions, answers)` from the Python file at `path` (importlib, no exec)."""
    if not allowed:
        raise ConfigError(custom_reward_refusal(path))
    if not path:
        raise ConfigError("grpo.rewards: a custom reward needs `path`, a Python file defining reward(...)")
    file = Path(path).expanduser().resolve()
    if not file.is_file() or file.suffix != ".py":
        raise ConfigError(f"grpo.rewards: custom reward file {file} does not exist or is not a .py file")
    name = "kestrel_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"grpo.rewards: cannot import {file}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's module may raise anything on import
        raise ConfigError(f"grpo.rewards: importing {file.name} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, "reward", None)
    if not callable(fn):
        raise ConfigError(f"grpo.rewards: {file.name} must define reward(prompts, completions, answers)")

    def call(batch: RewardBatch) -> list[float]:
        try:
            return fn(list(batch.prompts), list(batch.completions), list(batch.answers))
        except Exception as exc:  # report the user's error with its file, not a bare traceback
            raise RewardError(f"custom reward {file.name} raised {type(exc).__name__}: {exc}") from exc

    return call


# --- the weighted set -----------------------------------------------------------------------------


def _build_one(spec: RewardSpec, allow_custom: bool) -> RewardFn:
    if spec.name == "exact_answer":
        return exact_answer
    if spec.name == "format_regex":
        if not spec.pattern:
            raise ConfigError("grpo.rewards format_regex needs `pattern`, e.g. '<answer>.*</answer>'")
        return format_regex(spec.pattern)
    if spec.name == "length_penalty":
        if not spec.target_length or spec.target_length < 1:
            raise ConfigError("grpo.rewards length_penalty needs `target_length`, a positive number of tokens")
        return length_penalty(int(spec.target_length))
    if spec.name == "json_valid":
        return json_valid
    if spec.name == "custom":
        return load_custom_reward(spec.path, allow_custom)
    raise ConfigError(f"grpo.rewards: unknown reward {spec.name!r}; valid names: {', '.join(BUILTINS)}")


def _check_scores(key: str, scores: Any, n: int) -> torch.Tensor:
    if hasattr(scores, "tolist"):  # a numpy array or a tensor
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)) or len(scores) != n:
        got = type(scores).__name__ + (f" of length {len(scores)}" if hasattr(scores, "__len__") else "")
        raise RewardError(f"reward {key} must return a list of {n} numbers (one per completion), got {got}")
    ok = [isinstance(s, numbers.Real) and math.isfinite(s) for s in scores]
    if not all(ok):
        bad = scores[ok.index(False)]
        raise RewardError(f"reward {key} returned {bad!r}; every score must be a finite number")
    return torch.tensor([float(s) for s in scores], dtype=torch.float32)


def needs_answers(specs: list[RewardSpec]) -> bool:
    """Whether the rewards compare with a reference answer (rows without one are then unusable)."""
    return any(spec.name == "exact_answer" for spec in specs)


class RewardSet:
    """The configured rewards; calling it scores a batch. Keys are the names, made unique."""

    def __init__(self, specs: list[RewardSpec], allow_custom: bool = False) -> None:
        if not specs:
            raise ConfigError("grpo.rewards must list at least one reward")
        self.items: list[tuple[str, float, RewardFn]] = []
        for spec in specs:
            key, k = spec.name, 2
            while key in self.keys:
                key, k = f"{spec.name}_{k}", k + 1
            self.items.append((key, float(spec.weight), _build_one(spec, allow_custom)))
        self.needs_answers = needs_answers(specs)

    @property
    def keys(self) -> list[str]:
        return [key for key, _, _ in self.items]

    def __call__(self, batch: RewardBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> total (N,) fp32 = sum_k w_k r_k, and each reward's raw scores (N,) by key."""
        n = len(batch.completions)
        parts = {key: _check_scores(key, fn(batch), n) for key, _, fn in self.items}
        total = torch.zeros(n, dtype=torch.float32)
        for key, weight, _ in self.items:
            total += weight * parts[key]
        return total, parts
