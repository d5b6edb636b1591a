"""bench/graph_memory.py's reserved-memory report: segments summed by pool (default, CUDA graphs) and stream."""

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


def test_each_stream_apart_with_its_largest_free_blocks() -> None:
    mib = 2**20
    segments = [
        {"total_size": GIB, "allocated_size": GIB // 2, "stream": 0,
         "blocks": [{"size": GIB // 2, "state": "active_allocated"}, {"size": 300 * mib, "state": "inactive"},
                    {"size": 212 * mib, "state": "inactive"}]},
        {"total_size": GIB // 4, "allocated_size": 0, "stream": 0x55, "blocks": [{"size": GIB // 4, "state": "inactive"}]},
    ]
    lines = reserved_by_pool(segments)
    assert lines[0].endswith("default pool, stream 0x0; largest free blocks 300, 212 MiB; 0.000 GiB in free blocks under 20 MiB")
    assert lines[1].endswith("0.250 cached,     1 segments  default pool, stream 0x55; largest free blocks 256 MiB; "
                             "0.000 GiB in free blocks under 20 MiB")


def test_the_cache_in_blocks_smaller_than_a_page_is_counted_apart() -> None:
    """The free blocks `empty_cache` cannot unmap under expandable segments (under a 20 MiB page)."""
    mib = 2**20
    blocks = [{"size": 19 * mib, "state": "inactive"}, {"size": 100 * mib, "state": "active_allocated"}] * 8
    blocks += [{"size": 40 * mib, "state": "inactive"}, {"size": 20 * mib, "state": "inactive"}]
    lines = reserved_by_pool([{"total_size": 1012 * mib, "allocated_size": 800 * mib, "blocks": blocks}])
    assert lines[0].endswith(f"largest free blocks 40, 20, 19, 19 MiB; {8 * 19 / 1024:.3f} GiB in free blocks under 20 MiB")
