"""Two models decoded as one batch (`ModelRows`): the studio's side-by-side view of a full
fine-tune and its base. Each row's greedy tokens must equal those of its model decoded alone,
rows of different lengths and a stop token included, in one decode loop."""

from __future__ import annotations

import pytest
import torch

from kestrel.decode.generate import Generator
from kestrel.decode.pair import ModelRows
from tests.support.tiny import tiny_model

VOCAB = 320


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on a shared CPU
    yield
    torch.set_num_threads(threads)


def _gen(seed: int, stops: list[int]) -> Generator:
    model = tiny_model("llama", VOCAB, seed=seed)
    return Generator(model, max_seq_len=256, stop_ids=stops)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_two_models_in_one_batch_equal_each_alone() -> None:
    base, tuned = _gen(0, []), _gen(1, [])
    prompts = [_prompt(9, seed=1), _prompt(23, seed=2)]
    alone = [base.generate([prompts[0]], 40).tokens[0], tuned.generate([prompts[1]], 40).tokens[0]]
    assert alone[0] != alone[1]
    pair = Generator(ModelRows([base.backend, tuned.backend]), max_seq_len=256, stop_ids=[])
    calls = {"step": 0}
    step = pair.backend.step

    def counted(*args, **kwargs):
        calls["step"] += 1
        return step(*args, **kwargs)

    pair.backend.step = counted
    out = pair.generate(prompts, 40)
    assert out.tokens == alone
    assert calls["step"] == 39  # one loop: a step per token for both rows (the first comes from prefill)
    # Two rows per model: group g of the batch reads model g.
    four = pair.generate([prompts[0], prompts[1], prompts[1], prompts[0]], 12).tokens
    assert four == [alone[0][:12], base.generate([prompts[1]], 12).tokens[0],
                    alone[1][:12], tuned.generate([prompts[0]], 12).tokens[0]]


def test_a_row_that_stops_leaves_the_other_running() -> None:
    base, tuned = _gen(0, []), _gen(1, [])
    prompt = _prompt(11, seed=3)
    first = base.generate([prompt], 30).tokens[0]
    stop = first[5]  # the base row stops there; the tuned row, whose tokens differ, goes on
    tuned_alone = tuned.generate([prompt], 30, stop_ids=[stop]).tokens[0]
    pair = Generator(ModelRows([base.backend, tuned.backend]), max_seq_len=256, stop_ids=[stop])
    out = pair.generate([prompt, prompt], 30)
    assert out.tokens[0] == first[: first.index(stop) + 1] and out.finish_reasons[0] == "stop"
    assert out.tokens[1] == tuned_alone


def test_models_that_cannot_share_a_batch_are_refused() -> None:
    base = _gen(0, [])
    other = Generator(tiny_model("llama", VOCAB + 64, seed=0), max_seq_len=256, stop_ids=[])
    with pytest.raises(ValueError, match="same vocabulary size"):
        ModelRows([base.backend, other.backend])
    pair = Generator(ModelRows([base.backend, _gen(1, []).backend]), max_seq_len=256, stop_ids=[])
    with pytest.raises(ValueError, match="does not split over 2 models"):
        pair.generate([_prompt(5, seed=0)] * 3, 4)
