"""bench/memory_peak.peak_report on a hand-made allocator trace: the live blocks at the highest point,
not at the end, and a block freed before the peak is not counted."""

from __future__ import annotations

from bench.memory_peak import peak_report

MIB = 2**20


def _ev(action: str, addr: int, size: int = 0, where: str = "") -> dict:
    frames = [{"filename": f"/x/kestrel/{where}.py", "line": 1, "name": "f"}] if where else []
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_the_peak_is_found_in_the_middle_of_the_trace_with_its_own_live_blocks() -> None:
    trace = [_ev("alloc", 1, 10 * MIB, "a"), _ev("alloc", 2, 20 * MIB, "b"), _ev("free_completed", 1),
             _ev("alloc", 3, 40 * MIB, "c"),  # the peak: b + c = 60 MiB
             _ev("free_completed", 3), _ev("alloc", 4, 30 * MIB, "d"), _ev("free_requested", 2)]
    report = peak_report(trace)
    first, *sites = report.splitlines()
    assert "0.059 GiB in 2 blocks" in first
    assert [line.split()[-2] for line in sites] == ["kestrel/c.py:1", "kestrel/b.py:1"]
    assert "40.0 MiB" in sites[0] and "20.0 MiB" in sites[1]


def test_the_reserved_peak_is_the_moment_mapped_segments_peak_on_top_of_what_was_reserved_before() -> None:
    """A trace begun after the model was built (`base` reserved then): segments unmapped that the trace never saw
    mapped still count down, and the report names the moment, its streams and the blocks live then."""
    from bench.memory_peak import reserved_report

    trace = [_ev("segment_map", 100, 64 * MIB), _ev("alloc", 100, 60 * MIB, "eager"),
             dict(_ev("segment_map", 900, 32 * MIB), stream=7), dict(_ev("alloc", 900, 30 * MIB, "graph"), stream=7),
             _ev("free_completed", 100), _ev("segment_unmap", 100, 64 * MIB),  # the peak was just before: 96 MiB
             _ev("segment_unmap", 5, 16 * MIB),  # mapped before the trace began
             _ev("segment_map", 200, 40 * MIB, "later")]
    report = reserved_report(trace, base=512 * MIB).splitlines()
    assert report[0].startswith(f"reserved at its peak: {(512 + 96) / 1024:.3f} GiB")
    assert "stream 0: reserved 0.062 GiB, allocated 0.059" in report[2] and "stream 7: reserved 0.031 GiB" in report[3]
    assert any("kestrel/eager.py:1" in line for line in report) and any("kestrel/graph.py:1" in line for line in report)
