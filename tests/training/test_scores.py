"""Exact match and ROUGE-L against values worked out by hand (and `rouge_score`'s rougeL)."""

from __future__ import annotations

import pytest

from kestrel.training.scores import exact_match, lcs_length, normalize, rouge_l


def test_lcs_of_known_sequences() -> None:
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4  # the textbook example (BCBA)
    assert lcs_length(list("AGGTAB"), list("GXTXAYB")) == 4  # GTAB
    assert lcs_length([], ["a"]) == lcs_length(["a"], []) == 0
    assert lcs_length(["a", "b"], ["c"]) == 0


def test_rouge_l_known_values() -> None:
    # LCS "the cat on the mat" = 5 of 6 words each way.
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx({"p": 5 / 6, "r": 5 / 6, "f": 5 / 6})
    # Candidate 3 words, reference 6, LCS 3: P = 1, R = 1/2, F = 2/3.
    assert rouge_l("the answer 7", "so the answer is 7 indeed") == pytest.approx({"p": 1.0, "r": 0.5, "f": 2 / 3})
    # Order matters: the reversed sentence shares only one word in order.
    assert rouge_l("c b a", "a b c")["f"] == pytest.approx(1 / 3)
    assert rouge_l("", "anything") == {"p": 0.0, "r": 0.0, "f": 0.0}
    assert rouge_l("Identical, text!", "identical text")["f"] == 1.0


def test_exact_match_normalises_case_punctuation_and_spaces() -> None:
    assert normalize("  The Answer:\tis 7. ") == "the answer is 7"
    assert exact_match("The answer is 7.", "the answer is 7") == 1.0
    assert exact_match("The answer is 8.", "the answer is 7") == 0.0
