"""bench.common.step_recorder: each step's record says how long CPython's full garbage
collections stalled the host since the step before, and the clock leaves with the run."""

from __future__ import annotations

import gc

from bench.common import step_recorder


def test_full_collections_are_timed_per_step_and_the_clock_unhooks() -> None:
    steps: list[dict[str, float]] = []
    record = step_recorder(steps)
    gc.disable()  # only the collections asked for below
    try:
        record.on_step({"step": 1.0})
        kept = [[i] for i in range(200_000)]  # something for a full collection to walk
        gc.collect(2)
        gc.collect(1)  # not a full collection: not counted
        record.on_step({"step": 2.0})
        record.on_step({"step": 3.0})
        del kept
    finally:
        gc.enable()
    assert steps[0]["gc_full_ms"] == 0.0 and steps[1]["gc_full_ms"] > 0.0 and steps[2]["gc_full_ms"] == 0.0
    record.on_end("completed")
    assert all(getattr(cb, "__self__", None) is not record for cb in gc.callbacks)
