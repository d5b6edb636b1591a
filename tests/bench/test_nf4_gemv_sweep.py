"""bench/nf4_gemv_sweep.py on the CPU: a candidate that fails to compile or run in a compile worker
(the PRMT lookup's inline PTX, most likely) is recorded for that candidate and the sweep goes on:
never run again in the sweep's own process, never chosen; a fault that breaks a worker's CUDA
context fails the rest of that lookup's tasks there, and a worker that dies fails its PRMT tasks.
The grid times PRMT next to PAIR (and the model's tiles with all three lookups)."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pytest

from bench import nf4_gemv_sweep as sweep
from kestrel.kernels.decode.nf4_gemv import NIBBLE, PAIR, PRMT, Tiles

TASKS = [("o", Tiles(1, 8, 512, 1, 2, lookup=lookup)) for lookup in (PAIR, PRMT, NIBBLE)]


@pytest.fixture(autouse=True)
def _kernels_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_compile` (a worker's entry point) sets KESTREL_KERNELS=triton in its process; here that is
    the test process, so the setting is put back afterwards (left set, every later test would run
    the Triton kernels through the CPU interpreter)."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")


def test_a_failing_candidate_is_recorded_and_the_worker_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = []

    def run_once(name, t, weights):
        ran.append(t.lookup)
        if t.lookup == PRMT:
            raise RuntimeError("ptxas error: Unexpected instruction types")

    monkeypatch.setattr(sweep, "_run_once", run_once)
    monkeypatch.setattr(sweep, "_cuda_alive", lambda: True)
    out = sweep._compile(TASKS + TASKS)
    assert ran == [PAIR, PRMT, NIBBLE] * 2
    assert out[0] == out[2] == "" and out[1].startswith("error in a compile worker: RuntimeError: ptxas error")


def test_a_fault_that_breaks_the_context_fails_that_lookup_only(monkeypatch: pytest.MonkeyPatch) -> None:
    alive = [True]

    def run_once(name, t, weights):
        if t.lookup == PRMT:
            alive[0] = False
            raise RuntimeError("CUDA error: an illegal instruction was encountered")

    monkeypatch.setattr(sweep, "_run_once", run_once)
    monkeypatch.setattr(sweep, "_cuda_alive", lambda: alive[0])
    out = sweep._compile(TASKS + TASKS)
    assert out[0] == "" and "illegal instruction" in out[1]
    assert out[2] == out[3] == "" and out[5] == ""  # left to the sweep's own process
    assert out[4].startswith("not run: a prmt candidate broke a compile worker")


class _Pool:
    """A process pool whose second chunk's worker dies."""

    def __init__(self, workers, mp_context=None):
        self.calls = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, chunk):
        self.calls += 1
        future: Future = Future()
        if self.calls == 2:
            future.set_exception(BrokenProcessPool("a child process terminated abruptly"))
        else:
            future.set_result(["" if t.lookup != PRMT else "error in a compile worker: boom" for _, t in chunk])
        return future


def test_a_dead_worker_fails_its_prmt_tasks_and_the_sweep_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep, "ProcessPoolExecutor", _Pool)
    monkeypatch.setattr(sweep, "shape_tasks", lambda name, sms: [(1, t) for _, t in TASKS])
    errors = sweep.compile_all(["o", "down"], 132, workers=2)
    # chunk 0: o's PAIR, o's NIBBLE, down's PRMT; chunk 1 (dead): o's PRMT, down's PAIR, down's NIBBLE
    assert errors == {("down", TASKS[1][1]): "error in a compile worker: boom",
                      ("o", TASKS[1][1]): errors[("o", TASKS[1][1])]}
    assert errors[("o", TASKS[1][1])].startswith("not run: its compile worker died (BrokenProcessPool")


def test_checker_never_runs_a_candidate_that_failed_in_a_worker() -> None:
    checker = sweep.Checker.__new__(sweep.Checker)  # no CUDA: problem() must answer before touching it
    assert checker.problem(TASKS[1][1], "error in a compile worker: boom") == "error in a compile worker: boom"


def test_the_grid_times_prmt_beside_pair_and_the_model_tiles_with_every_lookup() -> None:
    tasks = sweep.shape_tasks("qkv", 132)
    grid = [t for at, t in tasks if at in (0, 1)]
    assert {t._replace(lookup=PAIR) for t in grid if t.lookup == PRMT} == {t for t in grid if t.lookup == PAIR}
    for m in sweep.ROWS:
        assert {t.lookup for at, t in tasks if at == m} == {NIBBLE, PAIR, PRMT}


def test_the_second_phase_varies_the_fastest_prmt_tiles_only() -> None:
    fast = [Tiles(16, 64, 128, 8, 4, lookup=PRMT, prefetch=p) for p in (True, False)]
    slow = Tiles(16, 32, 128, 8, 4, lookup=PRMT)
    timed = {fast[0]: 10.0, fast[1]: 11.0, slow: 30.0, Tiles(16, 64, 128, 8, 4, lookup=PAIR): 5.0}
    got = sweep.refinements(timed, top=2)
    assert len(got) == len(set(got)) == 2 * len(sweep.PARTS) * len(sweep.STAGES) - 2  # the two timed ones left out
    assert {t._replace(parts=1, stages=1) for t in got} == set(fast)  # neither PAIR nor the third-fastest
    assert {(t.parts, t.stages) for t in got if t.prefetch} == {(p, s) for p in sweep.PARTS for s in sweep.STAGES} - {(1, 1)}
    assert sweep.refinements({}) == []


def test_one_row_variants_add_two_row_groups_without_prefetch_at_one_and_two_row_tiles() -> None:
    t = Tiles(1, 8, 512, 1, 2, lookup=PRMT, prefetch=True)
    got = sweep.variants(t)
    assert len(got) == len(set(got)) == 3 * len(sweep.PARTS) * len(sweep.STAGES) and t in got
    grouped = [v for v in got if v.groups == 2]
    assert {v.block_n for v in grouped} == {8, 16} and not any(v.prefetch for v in grouped)
    assert all(v.groups == 1 for v in sweep.variants(t._replace(block_m=16)))
