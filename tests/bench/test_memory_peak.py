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
