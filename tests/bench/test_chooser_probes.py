"""`bench/chooser_probes.py`: the matrix's batches replayed through the CUDA-graph chooser with a fake clock."""

from __future__ import annotations

from bench.chooser_probes import probe
from bench.matrix import plan_batches


def _host_bound(n: int, graphed: bool) -> float:
    return n * 1e-5 * 1.02 + 0.001 if graphed else max(n * 1e-5, 0.25)


def test_the_defaults_decide_a_padded_runs_layouts_sooner_than_timing_each_to_the_end() -> None:
    tokens = [b.input_ids.numel() for b in plan_batches("padded", 1000, True, 16, 0)]
    assert len(set(tokens)) > 3  # padded rows: several layouts taking turns
    now, now_eager = probe(tokens, _host_bound)
    old, old_eager = probe(tokens, _host_bound, warmup=3, decisive=float("inf"))
    assert now is not None and old is not None
    assert now < old and now_eager <= old_eager


def test_a_layout_never_decided_within_the_limit_says_so() -> None:
    level = probe([100, 200], lambda n, graphed: 0.1, most=3)  # 3 forwards: too few to time anything
    assert level[0] is None
