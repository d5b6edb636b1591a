"""bench/product_loop.py on the CPU: one run of the product loop (a tiny model standing for the matrix's), its
rows and tokens turned into a wall-clock rate; and that rate's arithmetic on made-up rows."""

from __future__ import annotations

import argparse

import pytest

from bench import product_loop


def test_steady_counts_the_steps_after_the_warmup_by_the_wall_clock() -> None:
    rows = [dict(step=i, tokens_per_s=999.0, elapsed_s=0.5 * i) for i in range(1, 7)]
    got = product_loop.steady(rows, {i: 100 * i for i in range(1, 7)}, warmup=2)
    # steps 4..6 (400 + 500 + 600 tokens) between step 3's report (1.5 s) and step 6's (3.0 s)
    assert got["tokens_per_s"] == pytest.approx(1500 / 1.5) and got["steps"] == 3
    with pytest.raises(ValueError, match="more than 7 needed"):
        product_loop.steady(rows, {}, warmup=6)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_one_run_reports_every_step_with_its_tokens(tiny_model_dir, monkeypatch, mode: str) -> None:
    import bench.matrix_models as models
    from kestrel.training import sft

    monkeypatch.setattr(models, "build_model_dir", lambda name: tiny_model_dir("llama"))
    monkeypatch.setattr(sft, "runs_ahead", sft.runs_ahead)  # the run may replace it: undone after the test
    monkeypatch.setattr(sft, "accumulate", sft.accumulate)
    args = argparse.Namespace(one=mode, model="tiny", method="lora", seq=64, batch=2, steps=5)
    got = product_loop.one(args)
    steps = [r["step"] for r in got["rows"] if "tokens_per_s" in r]
    assert steps == [1, 2, 3, 4, 5] and sorted(got["tokens"]) == steps and min(got["tokens"].values()) > 0
    assert product_loop.steady(got["rows"], got["tokens"], warmup=1)["tokens_per_s"] > 0


def test_runs_go_in_the_given_order_each_tagged_and_averaged_by_mode(monkeypatch, capsys) -> None:
    from bench import common

    calls = []

    def isolated(script: str, args: list[str], timeout: int = 900) -> dict:
        calls.append(args)
        mode = args[-1]
        return {"error": "boom"} if len(calls) == 3 else {"tokens_per_s": {"off": 10.0, "on": 12.0}[mode]}

    monkeypatch.setattr(common, "run_isolated", isolated)
    runs = common.runs_in_order("x.py", ["--model", "m"], "off,on,on,off", "ahead")
    assert calls == [["--model", "m", "--one", m] for m in ("off", "on", "on", "off")]
    assert [r["ahead"] for r in runs] == ["off", "on", "on", "off"] and runs[2] == {"ahead": "on", "error": "boom"}
    assert "on: failed: boom" in capsys.readouterr().out
    assert common.mean_by(runs, "ahead", "tokens_per_s") == {"off": 10.0, "on": 12.0}  # the failed run left out
