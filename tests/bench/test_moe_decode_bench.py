"""bench/moe_decode.py's parts that need no GPU: its command line, the bytes a launch needs (distinct
chosen experts once each, NF4 at its stored size) and the per-layer summary."""

from __future__ import annotations

import pytest
import torch

from bench import moe_decode
from kestrel.kernels.moe import PackedExperts


def test_help_runs_and_a_cpu_run_says_it_needs_a_gpu(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as done:
        moe_decode.main(["--help"])
    assert done.value.code == 0 and "--out" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="GPU machine"):
        moe_decode.main([])


def test_needed_bytes_count_each_distinct_expert_once() -> None:
    w = torch.zeros(4, 8, 64, dtype=torch.bfloat16)
    ids = [torch.tensor([0, 0, 1]), torch.tensor([2, 3, 1])]  # 2 and 3 distinct: 2.5 experts a launch
    assert moe_decode.needed_bytes(ids, w) == 2.5 * 8 * 64 * 2
    packed = PackedExperts(w.float().normal_(), transposed=False)
    assert 0.25 * 8 * 64 * 2 <= moe_decode.expert_bytes(packed) < 0.27 * 8 * 64 * 2  # ~0.53 byte a weight


def test_layer_rows_add_the_projections_and_give_the_ratio() -> None:
    rows = [{"model": "m", "weights": "bf16", "rows": 1, "impl": impl, "projection": p, "us": us, "needed_bytes": 1e6}
            for impl, p, us in [("gather", "gate_up", 30.0), ("gather", "down", 10.0), ("kernel", "gate_up", 6.0),
                                ("kernel", "down", 4.0)]]
    layer = moe_decode.layer_rows(rows)
    assert [r["us"] for r in layer if "us" in r] == [40.0, 10.0]
    assert layer[1]["gb_per_s"] == 200.0 and layer[-1]["speedup"] == 4.0
