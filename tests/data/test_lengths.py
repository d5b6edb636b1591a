"""Truncation warnings (kestrel/data/lengths.py) and whole-character token pieces
(kestrel/data/tokenize.decode_pieces)."""

from __future__ import annotations

import pytest

from kestrel.data.lengths import FIT_SHARE, MIN_LENGTH_STEP, TRUNCATION_WARN_SHARE, fit_length, round_up_length, truncation
from kestrel.data.tokenize import decode_pieces


@pytest.mark.parametrize("n, rounded", [(1, 16), (16, 16), (17, 32), (100, 112), (300, 320), (1500, 1536),
                                        (2048, 2048), (2049, 2304), (5000, 5120)])
def test_lengths_round_up_to_an_eighth_of_their_power_of_two(n: int, rounded: int) -> None:
    assert round_up_length(n) == rounded and rounded >= n and rounded % MIN_LENGTH_STEP == 0


def test_warning_from_the_threshold_on_with_a_length_that_fits() -> None:
    rows = 200
    at_threshold = int(TRUNCATION_WARN_SHARE * rows)
    lengths = [50] * (rows - at_threshold) + [700] * at_threshold
    assert truncation(lengths[:-1], 100) is None  # one long row fewer: under the threshold
    found = truncation(lengths, 100)
    assert found is not None and (found.over, found.rows, found.share) == (at_threshold, rows, TRUNCATION_WARN_SHARE)
    assert found.fits == round_up_length(50)  # the long rows are the last 5%: FIT_SHARE of rows are 50 tokens
    spread = list(range(1, 1001))
    assert fit_length(spread) == round_up_length(int(FIT_SHARE * 1000))
    assert sum(n <= fit_length(spread) for n in spread) >= FIT_SHARE * len(spread)
    assert truncation([], 64) is None and truncation([10], 0) is None


@pytest.mark.parametrize("text", ["It is 25°C, 3×4 = 12, −1", "🙂👍🏽 emoji", "日本語のテキスト", "plain ascii words"])
def test_pieces_are_whole_characters_that_join_to_the_text(demo_tokenizer, text: str) -> None:
    ids = demo_tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = decode_pieces(demo_tokenizer, ids)
    assert "".join(p for p, _, _ in pieces) == demo_tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p, _, _ in pieces)
    assert [(a, b) for _, a, b in pieces] == list(zip([0] + [b for _, _, b in pieces[:-1]], [b for _, _, b in pieces]))
    assert pieces[-1][2] == len(ids)


def test_a_lone_fragment_at_the_end_stays_visible(demo_tokenizer) -> None:
    ids = demo_tokenizer("x°", add_special_tokens=False)["input_ids"][:-1]  # the last byte of ° cut off
    pieces = decode_pieces(demo_tokenizer, ids)
    assert pieces[-1][2] == len(ids) and pieces[-1][0].endswith("\ufffd")
