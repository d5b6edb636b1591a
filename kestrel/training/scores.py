"""Scores of a generated answer against its reference: exact match and ROUGE-L.

    exact_match("The answer is 7.", " the answer is 7")   -> 1.0   (normalised text)
    rouge_l("the cat sat on the mat", "the cat is on the mat")["f"]  -> 0.833...

Both compare normalised text: lower case, punctuation removed, whitespace collapsed (the
usual SQuAD-style normalisation). ROUGE-L is the longest common subsequence (LCS) of the two
word sequences: precision = LCS / candidate words, recall = LCS / reference words,
F = 2PR / (P + R) (the balanced F1, as `rouge_score` reports `rougeL` fmeasure).
"""

from __future__ import annotations

import re
import string

_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")


def normalize(text: str) -> str:
    """Lower case, punctuation out, runs of whitespace as one space, trimmed."""
    return " ".join(_PUNCT.sub(" ", text.lower()).split())


def exact_match(candidate: str, reference: str) -> float:
    """1.0 when the normalised texts are equal, else 0.0."""
    return float(normalize(candidate) == normalize(reference))


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two sequences: the classic dynamic programme,
    one row of len(b) + 1 cells at a time (O(len(a) * len(b)) time, O(len(b)) memory)."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        row = [0]
        for j, y in enumerate(b):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
        prev = row
    return prev[-1]


def rouge_l(candidate: str, reference: str) -> dict[str, float]:
    """ROUGE-L precision `p`, recall `r` and F1 `f` over normalised words (all 0 when either is empty)."""
    cand, ref = normalize(candidate).split(), normalize(reference).split()
    common = lcs_length(cand, ref)
    if common == 0:
        return {"p": 0.0, "r": 0.0, "f": 0.0}
    p, r = common / len(cand), common / len(ref)
    return {"p": p, "r": r, "f": 2 * p * r / (p + r)}
