"""The loss-chunk bench's cost model (`bench/ce_floor.py`): the chunk a device's ridge point names."""

from __future__ import annotations

from bench.ce_floor import ridge_rows


def test_the_model_names_the_smallest_128_row_multiple_at_the_ridge_within_the_floor_s_range() -> None:
    assert ridge_rows(700e12, 4.2e12) == 256  # ridge 167 flop a byte: 256 rows reach it, 128 do not
    assert ridge_rows(600e12, 2.4e12) == 256  # exactly 250: the multiple at or above
    assert ridge_rows(700e12, 1.9e12) == 384  # 368
    assert ridge_rows(1e15, 1e12) == 512  # far past the floor: never more than today's 512
    assert ridge_rows(50e12, 1e12) == 128  # a slow product rate: never under 128 rows
    rates = [ridge_rows(700e12, bw * 1e12) for bw in (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)]
    assert rates == sorted(rates, reverse=True)  # more bandwidth, fewer rows needed
