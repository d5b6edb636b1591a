"""Python's cyclic garbage collector during a run's steps: the objects alive when the steps begin
(the imported libraries' functions and dicts, the model's modules: about half a million objects
in a trainer process) are moved to the collector's permanent generation for the loop.

Why: a full (generation 2) collection walks every tracked object. CPython starts one every so
often as a step's short-lived objects are promoted, and then the host stalls for as long as the
walk takes while the GPU drains its queue: a step now and then is that much slower for no work of
its own. Objects frozen here are never walked; everything made during the loop is collected as
before, and cyclic garbage among the frozen objects waits for the end of the loop (the setup's
garbage is collected just before freezing, so there is little).

    with steps_heap():
        status = loop_fn(state, callbacks)
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


# Full collections during a loop after which the survivors are frozen too. Off by default: on the
# GPU it did not keep the warm-up's collections away (bench/RESULTS.md, DPO, session 20), and what
# it freezes is only collected after the loop, later than before.
REFREEZES = 0


@contextmanager
def steps_heap(refreezes: int = REFREEZES) -> Iterator[int]:
    """Collect, freeze what is alive, run the block, unfreeze; yields how many objects were frozen.

    The first steps make long-lived objects of their own (compiled kernels, captured CUDA graphs,
    autotuning caches: several hundred thousand on a QLoRA run), which a full collection would walk
    again and again. With `refreezes` the first that many full collections inside the block freeze
    their survivors as well: a full collection has just freed the cyclic garbage, so what is frozen is
    alive, and what dies later is still freed by its reference count. Only a cycle among objects
    alive at one of those few moments waits for the end of the block.

    A freeze is process-wide and does not nest: when one is already in place (a caller's own),
    this leaves it alone and yields 0."""
    if gc.get_freeze_count():
        yield 0
        return
    gc.collect()
    gc.freeze()
    left = [refreezes]

    def after_full_collection(phase: str, info: dict) -> None:
        # Runs once the collection is over (the "stop" callback): freezing then is what a call
        # right after `gc.collect()` would do; it never walks or frees anything.
        if phase == "stop" and info.get("generation") == 2 and left[0] > 0:
            left[0] -= 1
            gc.freeze()

    gc.callbacks.append(after_full_collection)
    try:
        yield gc.get_freeze_count()
    finally:
        gc.callbacks.remove(after_full_collection)
        gc.unfreeze()
