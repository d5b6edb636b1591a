"""GRPO rewards: answer extraction and matching, each built-in on edge cases, the weighted set,
and custom reward files (opt-in only, errors named)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import torch

from kestrel.config import RewardSpec
from kestrel.errors import ConfigError
from kestrel.training.grpo.rewards import (
    RewardBatch, RewardError, RewardSet, answers_match, extract_answer, last_boxed, parse_number,
)


def _batch(completions: list[str], answers: list[str | None] | None = None, lengths: list[int] | None = None) -> RewardBatch:
    n = len(completions)
    return RewardBatch(["q"] * n, completions, answers or ["7"] * n, lengths or [1] * n)


@pytest.mark.parametrize("text, expected", [
    ("7 + 3 = 10. The answer is 10.", "10"),
    ("first 3, then <answer> 42 </answer>, finally 9", "42"),  # the tag wins over a later number
    ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last tag
    ("so \\boxed{\\frac{1}{2}} and 5", "\\frac{1}{2}"),  # boxed wins over a later number
    ("nested \\boxed{2^{10}} ok", "2^{10}"),
    ("unclosed \\boxed{3 and then 4", "4"),  # an unclosed box is ignored
    ("<answer>\\boxed{12}</answer>", "12"),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),  # GSM8K's marker
    ("5-3", "3"),  # a minus glued to a digit is an operator, not a sign
    ("it is -5", "-5"),
    ("costs \u22124 dollars", "-4"),  # unicode minus
    ("Paris", "Paris"),  # no number: the text itself
    ("   ", None),
    ("", None),
])
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text, value", [
    ("1,234", Fraction(1234)), ("-0.50", Fraction(-1, 2)), ("$12", Fraction(12)), ("3/4", Fraction(3, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)), ("50%", Fraction(50)), ("7.", Fraction(7)), ("1/0", None), ("abc", None),
    ("inf", None), ("", None), ("\\frac{1}{0}", None),
])
def test_parse_number(text: str, value: Fraction | None) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize("completion, reference, ok", [
    ("The answer is 1,234.", "1234", True),
    ("The answer is 42.0", "42", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("The answer is 41.", "42", False),
    ("<answer>7</answer> but 8", "7", True),
    ("I think 7 or maybe 8", "7", False),  # the final number counts
    ("14 - 0 = 14. The answer is 14.", "Reasoning... #### 14", True),  # the reference is extracted too
    ("paris", "Paris", True),  # text compares case-insensitively
    ("The capital is Paris.", "Paris", False),  # text must be the whole answer
    ("no number here", "7", False),
    ("", "7", False),
])
def test_answers_match(completion: str, reference: str, ok: bool) -> None:
    assert answers_match(completion, reference) is ok


def test_last_boxed_picks_the_last_closed_box() -> None:
    assert last_boxed("\\boxed{1} \\boxed{{2}}") == "{2}"
    assert last_boxed("\\boxed{1} \\boxed{2") == "1"
    assert last_boxed("none") is None


def test_exact_answer_is_zero_without_a_reference() -> None:
    rewards = RewardSet([RewardSpec("exact_answer")])
    total, parts = rewards(_batch(["The answer is 7.", "The answer is 7."], answers=["7", None]))
    assert total.tolist() == [1.0, 0.0] and parts["exact_answer"].tolist() == [1.0, 0.0]


def test_format_regex_searches_across_lines_and_honours_anchors() -> None:
    loose = RewardSet([RewardSpec("format_regex", pattern=r"<answer>.*</answer>")])
    anchored = RewardSet([RewardSpec("format_regex", pattern=r"^<think>.*</think>\s*<answer>\d+</answer>$")])
    texts = ["<think>a\nb</think>\n<answer>3</answer>", "pre <answer>\n3\n</answer>", "<answer>3"]
    assert loose(_batch(texts))[0].tolist() == [1.0, 1.0, 0.0]
    assert anchored(_batch(texts))[0].tolist() == [1.0, 0.0, 0.0]


def test_length_penalty_is_zero_up_to_the_target_then_linear_to_minus_one() -> None:
    rewards = RewardSet([RewardSpec("length_penalty", target_length=10)])
    total, _ = rewards(_batch(["x"] * 5, lengths=[0, 10, 15, 20, 100]))
    assert total.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]


@pytest.mark.parametrize("text, ok", [
    ('{"a": 1}', True), ("[1, 2]", True), ('  {"a": [1, {"b": null}]}\n', True),
    ('Here:\n```json\n{"a": 1}\n```\nDone.', True), ("```\n[1]\n```", True),
    ("42", False), ('"text"', False), ('{"a": 1,}', False), ('{"a": 1', False), ("", False), ("null", False),
])
def test_json_valid(text: str, ok: bool) -> None:
    assert RewardSet([RewardSpec("json_valid")])(_batch([text]))[0].tolist() == [float(ok)]


def test_weighted_sum_and_unique_keys() -> None:
    specs = [RewardSpec("exact_answer", weight=2.0), RewardSpec("format_regex", weight=0.5, pattern="answer"),
             RewardSpec("format_regex", weight=-1.0, pattern="\\?")]
    rewards = RewardSet(specs)
    assert rewards.keys == ["exact_answer", "format_regex", "format_regex_2"] and rewards.needs_answers
    total, parts = rewards(_batch(["The answer is 7.", "answer 8?", "?"]))
    assert parts["exact_answer"].tolist() == [1.0, 0.0, 0.0]
    assert parts["format_regex_2"].tolist() == [0.0, 1.0, 1.0]
    torch.testing.assert_close(total, torch.tensor([2.5, -0.5, -1.0]))


@pytest.mark.parametrize("spec, message", [
    (RewardSpec("exactly"), "unknown reward 'exactly'; valid names: exact_answer"),
    (RewardSpec("format_regex"), "format_regex needs `pattern`"),
    (RewardSpec("format_regex", pattern="(unclosed"), "not a valid regex"),
    (RewardSpec("length_penalty"), "length_penalty needs `target_length`"),
    (RewardSpec("custom", path="r.py"), "allow_custom_rewards: true"),
])
def test_misconfigured_rewards_are_named(spec: RewardSpec, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("?", "\\?").replace("(", "\\(")):
        RewardSet([spec])


def _custom(tmp_path: Path, body: str) -> RewardSpec:
    path = tmp_path / "my_reward.py"
    path.write_text(body)
    return RewardSpec("custom", weight=0.5, path=str(path))


def test_custom_reward_loads_only_when_allowed(tmp_path: Path) -> None:
    spec = _custom(tmp_path, "def reward(prompts, completions, answers):\n"
                             "    return [float(len(c)) + (a == '7') for c, a in zip(completions, answers)]\n")
    with pytest.raises(ConfigError, match="runs? inside the training process.*allow_custom_rewards"):
        RewardSet([spec])
    total, parts = RewardSet([spec], allow_custom=True)(_batch(["ab", "abcd"], answers=["7", "8"]))
    assert parts["custom"].tolist() == [3.0, 4.0] and total.tolist() == [1.5, 2.0]


@pytest.mark.parametrize("body, error, message", [
    ("x = 1\n", ConfigError, "must define reward"),
    ("raise RuntimeError('boom')\n", ConfigError, "importing my_reward.py failed: RuntimeError: boom"),
    ("def reward(p, c, a):\n    return [1.0]\n", RewardError, "must return a list of 2 numbers"),
    ("def reward(p, c, a):\n    return [1.0, float('nan')]\n", RewardError, "returned nan"),
    ("def reward(p, c, a):\n    return [1.0, 'x']\n", RewardError, "returned 'x'"),
    ("def reward(p, c, a):\n    return 1 / 0\n", RewardError, "my_reward.py raised ZeroDivisionError"),
])
def test_custom_reward_errors_are_clear(tmp_path: Path, body: str, error: type, message: str) -> None:
    spec = _custom(tmp_path, body)
    with pytest.raises(error, match=message):
        RewardSet([spec], allow_custom=True)(_batch(["a", "b"]))


def test_custom_reward_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist or is not a .py file"):
        RewardSet([RewardSpec("custom", path=str(tmp_path / "nope.py"))], allow_custom=True)


def test_custom_reward_may_return_a_tensor(tmp_path: Path) -> None:
    spec = _custom(tmp_path, "import torch\ndef reward(p, c, a):\n    return torch.ones(len(c))\n")
    assert RewardSet([spec], allow_custom=True)(_batch(["a", "b"]))[1]["custom"].tolist() == [1.0, 1.0]
