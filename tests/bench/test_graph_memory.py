"""bench/graph_memory.py's reserved-memory report: segments summed by pool (default, CUDA graphs)."""

from __future__ import annotations

from bench.graph_memory import reserved_by_pool

GIB = 2**30


def test_reserved_memory_is_summed_by_pool_largest_first() -> None:
    segments = [
        {"total_size": 2 * GIB, "allocated_size": GIB, "segment_pool_id": (0, 0)},
        {"total_size": GIB, "allocated_size": 0},  # no pool id: the default pool
        {"total_size": 4 * GIB, "allocated_size": GIB // 2, "segment_pool_id": (7, 1)},
    ]
    lines = reserved_by_pool(segments)
    assert len(lines) == 2
    assert lines[0].startswith("   4.000 GiB reserved, 0.500 allocated, 3.500 cached,     1 segments  private pool (7, 1)")
    assert lines[1].startswith("   3.000 GiB reserved, 1.000 allocated, 2.000 cached,     2 segments  default pool")
