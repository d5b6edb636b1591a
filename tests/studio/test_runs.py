"""Runs tab handlers over real workers running the fake engine: table, live charts drawn from the
store, log tail, skipped redraws, stop / resume / cancel / delete, comparison."""

from __future__ import annotations

import gradio as gr
import pytest

from kestrel import jobs
from kestrel.studio.handlers import runs
from tests.studio.helpers import error_text, wait_for

CONFIG = {"model": "demo", "dataset": "arithmetic_chat", "max_steps": 20, "save_steps": 5}


def _skipped(value: object) -> bool:
    return isinstance(value, dict) and value.get("__type__") == "update" and len(value) == 1


def test_refresh_draws_the_running_job_then_skips_what_did_not_change(fake_engine: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.2")
    job_id = jobs.submit(CONFIG)
    wait_for(lambda: jobs.get_job(job_id).step >= 3, what="three steps")
    out = runs.refresh(None, {})
    table = out["table"]
    assert table.iloc[0, 0] == job_id and table.iloc[0, 2] == "running" and "%" in table.iloc[0, 3]
    assert out["select"]["value"] == job_id
    assert f"#{job_id}" in out["progress"] and "running" in out["progress"]
    loss = out["chart_loss"]
    assert list(loss.columns) == ["step", "value", "name"] and set(loss["name"]) == {"loss"}
    assert loss["step"].tolist() == list(range(1, len(loss) + 1)) and len(loss) >= 3
    assert loss["value"].tolist()[:3] == pytest.approx([10.0, 5.0, 10 / 3])
    assert set(out["chart_tokens_per_s"]["name"]) == {"tokens_per_s"} and out["chart_memory"].empty
    assert "fake engine" in out["log"]
    # A poll with nothing new redraws nothing (twenty open tabs stay cheap).
    seen = out["seen"]
    step = jobs.get_job(job_id).step
    again = runs.refresh(job_id, {**seen, "job": (job_id, "running", step),
                                  "jobs": [(j.id, j.status, step, j.total_steps) for j in jobs.list_jobs()],
                                  "log": jobs.log_tail(job_id, runs.LOG_LINES)})
    assert _skipped(again["chart_loss"]) and _skipped(again["table"]) and _skipped(again["log"])
    jobs.wait(job_id, timeout=60)
    done = runs.refresh(job_id, seen)
    assert done["table"].iloc[0, 2] == "completed" and len(done["chart_loss"]) == 20


def test_pause_resume_cancel_delete(fake_engine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.2")
    job_id = jobs.submit(CONFIG)
    wait_for(lambda: jobs.get_job(job_id).step >= 2, what="two steps")
    with pytest.raises(gr.Error) as excinfo:
        runs.act("delete", job_id)
    assert "is running; cancel it first" in error_text(excinfo)
    assert "stopping after its next checkpoint" in runs.act("pause", job_id)
    paused = jobs.wait(job_id, timeout=30)
    assert paused.status == "interrupted"
    assert "resumes from its last checkpoint" in runs.act("resume", job_id)
    wait_for(lambda: jobs.get_job(job_id).status == "running", what="the job running again")
    assert "stopping" in runs.act("cancel", job_id)
    assert jobs.wait(job_id, timeout=30).status == "cancelled"
    with pytest.raises(gr.Error) as excinfo:
        runs.act("pause", job_id)
    assert "already cancelled" in error_text(excinfo)
    out_dir = jobs.get_job(job_id).output_dir
    assert runs.act("delete", job_id, True) == f"Job #{job_id} deleted."
    assert jobs.list_jobs() == [] and not __import__("os").path.exists(out_dir)
    with pytest.raises(gr.Error) as excinfo:
        runs.act("resume", None)
    assert "Pick a run" in error_text(excinfo)


def test_compare_overlays_loss_and_lists_differences(fake_engine: None) -> None:
    a = jobs.submit({**CONFIG, "max_steps": 4, "learning_rate": 1e-4})
    b = jobs.submit({**CONFIG, "max_steps": 6, "learning_rate": 3e-4})
    jobs.wait(a, timeout=60), jobs.wait(b, timeout=60)
    out = runs.compare([a, b])
    loss = out["compare_loss"]
    assert sorted(loss.groupby("run").size().tolist()) == [4, 6]
    diff = out["compare_diff"]
    assert list(diff.columns) == ["setting", f"#{a}", f"#{b}"]
    assert set(diff["setting"]) == {"learning_rate", "max_steps"}
    with pytest.raises(gr.Error):
        runs.compare([a])


def test_no_jobs_yet() -> None:
    out = runs.refresh(None, {})
    assert out["table"].empty and "No runs yet" in out["progress"] and out["chart_loss"].empty


def test_clicking_a_table_row_selects_its_job() -> None:
    import pandas as pd

    table = pd.DataFrame([[5, "a"], [7, "b"]], columns=["#", "name"])
    assert runs.select_row(table, gr.SelectData(None, {"index": [1, 3], "value": "b", "selected": True})) == 7


def test_eval_loss_beside_train_loss_and_the_generation_check(fake_engine: None) -> None:
    import json
    from pathlib import Path

    from kestrel.jobs import queries

    job_id = jobs.submit({**CONFIG, "max_steps": 4})
    job = jobs.wait(job_id, timeout=60)
    assert runs.refresh(job_id, {}, force=True)["generation_summary"].startswith("No generation check")
    queries.write_metrics(job_id, [(2, "eval_loss", 3.0), (4, "eval_loss", 2.5)])
    check = {"step": 4, "exact_match": 0.5, "rouge_l": 0.75, "rows": [
        {"line": 3, "prompt": "1+1?", "reference": "2", "answer": "2", "exact_match": 1.0, "rouge_l": 1.0},
        {"line": 9, "prompt": "2+2?", "reference": "4", "answer": "four", "exact_match": 0.0, "rouge_l": 0.5}]}
    (Path(job.output_dir) / "generation_check.json").write_text(json.dumps(check))
    out = runs.refresh(job_id, {}, force=True)
    loss = out["chart_loss"]
    assert loss[loss["name"] == "eval_loss"][["step", "value"]].values.tolist() == [[2, 3.0], [4, 2.5]]
    assert len(loss[loss["name"] == "loss"]) == 4
    assert "2 held-out prompts at step 4" in out["generation_summary"] and "50%" in out["generation_summary"]
    table = out["generation_table"]
    assert table.values.tolist() == [["1+1?", "2", "2", "yes", 1.0], ["2+2?", "4", "four", "no", 0.5]]
    other = jobs.submit({**CONFIG, "max_steps": 3})
    jobs.wait(other, timeout=60)
    compared = runs.compare([job_id, other])["compare_loss"]
    assert sorted(set(compared["run"])) == sorted({f"#{job_id} {job.name}", f"#{job_id} {job.name} eval",
                                                   f"#{other} {jobs.get_job(other).name}"})
