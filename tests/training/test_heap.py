"""The step loop runs with the objects alive at its start frozen out of the garbage collector's
walks (`kestrel.training.heap`), and gives them back afterwards."""

from __future__ import annotations

import gc
from pathlib import Path

from kestrel.config import config_from_dict
from kestrel.training.heap import steps_heap
from kestrel.training.metrics import Callback
from kestrel.training.run import run


class FreezeSeen(Callback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_step(self, metrics: dict) -> None:
        self.counts.append(gc.get_freeze_count())


def test_steps_run_with_the_heap_frozen_and_it_is_given_back(tiny_model_dir, tmp_path: Path) -> None:
    seen = FreezeSeen()
    config = dict(model=str(tiny_model_dir("llama")), dataset="arithmetic_chat", output_dir=str(tmp_path / "run"),
                  max_seq_length=64, batch_size=2, max_steps=3, save_steps=0, seed=0, gradient_checkpointing="off")
    assert run(config_from_dict(config), [seen]).status == "completed"
    assert len(seen.counts) == 3 and min(seen.counts) > 10_000  # the libraries and the model, not a handful
    assert gc.get_freeze_count() == 0


def test_garbage_made_in_the_block_is_collected_and_a_callers_freeze_is_left_alone() -> None:
    class Node:
        pass

    with steps_heap() as frozen:
        assert frozen > 10_000 and gc.get_freeze_count() > 0
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made during the steps
        del a, b
        assert gc.collect() >= 2
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        outer = gc.get_freeze_count()
        with steps_heap() as frozen:
            assert frozen == 0
        # not unfrozen by the inner block (that empties the permanent generation); a frozen object
        # may still die meanwhile, which takes it out of the count
        assert outer - 100 <= gc.get_freeze_count() <= outer
    finally:
        gc.unfreeze()


def test_the_first_full_collections_in_the_block_freeze_their_survivors_only() -> None:
    class Node:
        pass

    callbacks = list(gc.callbacks)
    with steps_heap(refreezes=2) as frozen:
        kept = [Node() for _ in range(1000)]  # long-lived objects of the first steps
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2  # the cycle is collected, not frozen
        after_one = gc.get_freeze_count()
        assert after_one >= frozen + 1000  # the survivors joined the frozen heap
        young = [Node() for _ in range(1000)]
        gc.collect()
        after_two = gc.get_freeze_count()
        assert after_two >= after_one + 1000
        more = [Node() for _ in range(1000)]
        gc.collect()
        assert gc.get_freeze_count() < after_two + 1000  # only `refreezes` collections freeze (frozen objects may still die)
        c, d = Node(), Node()
        c.other, d.other = d, c
        del c, d
        assert gc.collect() >= 2  # garbage made later is still collected
    assert gc.get_freeze_count() == 0 and gc.callbacks == callbacks
    del kept, young, more
