"""bench/nf4_decode.py's report of where NF4 and dequantized greedy tokens part: how far below the
reference's best our token is, in bf16 spacings at the best logit (a tie, or a real difference)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bench.nf4_decode import compare, where_they_part


class FixedLogits(torch.nn.Module):
    """A reference whose last-position logits are given; it records the prefix it was called with."""

    def __init__(self, last: list[float]) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.last, self.seen = torch.tensor(last), []

    def forward(self, ids: torch.Tensor) -> SimpleNamespace:
        self.seen.append(ids[0].tolist())
        logits = torch.zeros(1, ids.shape[1], len(self.last))
        logits[0, -1] = self.last
        return SimpleNamespace(logits=logits)


def test_parting_at_a_tie_is_within_one_spacing_and_a_real_difference_is_not() -> None:
    tokens = {"nf4": {1: [[5, 6, 2]]}, "bf16_dequantized": {1: [[5, 6, 1]]}}
    entry = compare(tokens)["nf4_vs_bf16_dequantized_b1"]
    assert entry["first_difference"] == (0, 2) and not entry["identical"]
    prompts = {1: torch.tensor([[9, 8]])}
    # best 8.0 (bf16 spacing 2^-4 there); our token 2 one spacing below it: a tie
    tie = FixedLogits([0.0, 8.0, 8.0 - 2.0**-4, 3.0])
    got = where_they_part(tie, prompts, tokens, entry)
    assert tie.seen == [[9, 8, 5, 6]]  # the prompt and the reference's tokens before the parting
    assert got["ours_rank"] == 1 and abs(got["ours_below_best_ulps"] - 1.0) < 1e-6
    real = where_they_part(FixedLogits([0.0, 8.0, 5.0, 3.0]), prompts, tokens, entry)
    assert real["ours_rank"] == 1 and real["ours_below_best_ulps"] == 48.0
    assert where_they_part(tie, prompts, {"nf4": {1: [[5]]}, "bf16_dequantized": {1: [[5]]}},
                           compare({"nf4": {1: [[5]]}, "bf16_dequantized": {1: [[5]]}})["nf4_vs_bf16_dequantized_b1"]) == {}
