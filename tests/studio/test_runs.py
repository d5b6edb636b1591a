"""Runs tab handlers over real workers running the fake engine: table, live charts drawn from the
store, log tail, skipped redraws, stop / resume / cancel / delete, comparison."""

from __future__ import annotations

import time
from pathlib import Path

import gradio as gr
import pandas as pd
import pytest
from sqlalchemy import update

from kestrel import jobs
from kestrel.jobs import queries
from kestrel.studio.handlers import runs
from tests.studio.helpers import error_text, wait_for

CONFIG = {"model": "demo", "dataset": "arithmetic_chat", "max_steps": 20, "save_steps": 5}


def _frame(value: object) -> pd.DataFrame:
    """A chart's new value, whether sent alone or in a gr.update."""
    return value["value"] if isinstance(value, dict) else value  # type: ignore[return-value,index]


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
    loss = _frame(out["chart_loss"])
    assert list(loss.columns) == ["step", "value", "name"] and set(loss["name"]) == {"loss"}
    assert loss["step"].tolist() == list(range(1, len(loss) + 1)) and len(loss) >= 3
    assert loss["value"].tolist()[:3] == pytest.approx([10.0, 5.0, 10 / 3])
    assert set(_frame(out["chart_tokens_per_s"])["name"]) == {"tokens_per_s"}
    assert out["chart_memory"]["value"].empty and "trains on the CPU" in out["chart_memory"]["title"]
    # The poll after new series rebuilds the page's chart with them (its colour domain is fixed at build).
    rebuilt = runs.refresh(job_id, out["seen"])
    assert rebuilt["chart_loss"]["colors_in_legend"] == ["loss"] and "colors_in_legend" not in out["chart_loss"]
    assert isinstance(runs.refresh(job_id, rebuilt["seen"])["chart_loss"], (pd.DataFrame, dict))
    assert "fake engine" in out["log"]
    # A poll with nothing new redraws nothing (twenty open tabs stay cheap).
    seen = rebuilt["seen"]
    step = jobs.get_job(job_id).step
    again = runs.refresh(job_id, {**seen, "job": (job_id, "running", step),
                                  "jobs": [(j.id, j.status, step, j.total_steps) for j in jobs.list_jobs()],
                                  "log": jobs.log_tail(job_id, runs.LOG_LINES)})
    assert _skipped(again["chart_loss"]) and _skipped(again["table"]) and _skipped(again["log"])
    jobs.wait(job_id, timeout=60)
    done = runs.refresh(job_id, seen)
    assert done["table"].iloc[0, 2] == "completed" and len(_frame(done["chart_loss"])) == 20


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
    assert out["table"].empty and "No runs yet" in out["progress"] and _frame(out["chart_loss"]).empty


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
def _set_job(job_id: int, **values: object) -> None:
    with jobs.session(immediate=True) as s:
        s.execute(update(jobs.Job).where(jobs.Job.id == job_id).values(**values))


def test_charts_are_numeric_before_the_first_point() -> None:
    """gr.LinePlot takes each axis's type from the column's dtype: an empty frame must already be
    numeric, or the first run in a fresh page is drawn with categorical axes."""
    frames = runs.chart_frames(None)
    for key in runs.CHART_SERIES:
        frame = frames[f"chart_{key}"]
        types = gr.LinePlot(x="step", y="value", color="name").postprocess(frame).datatypes
        assert types["step"] == types["value"] == "quantitative", (key, types)


def test_eta_counts_only_the_steps_since_the_resume() -> None:
    """Resumed at step 50 and 10 s into the new attempt at step 60 of 100: 40 steps at 1 s each.
    Counting all 60 steps over those 10 s would promise under 7 s."""
    job_id = jobs.submit(CONFIG, start=False)
    now = time.time()
    queries.write_metrics(job_id, [(s, "loss", 1.0) for s in range(1, 61)], at=now - 500)
    checkpoint = Path(jobs.get_job(job_id).output_dir) / "checkpoints" / "step-000050"
    checkpoint.mkdir(parents=True)
    queries.record_artifact(job_id, "checkpoint", checkpoint, 50)
    with jobs.session(immediate=True) as s:  # written during the first attempt
        s.execute(update(jobs.Artifact).where(jobs.Artifact.job_id == job_id).values(created_at=now - 400))
    queries.write_metrics(job_id, [(s, "loss", 1.0) for s in range(51, 61)], at=now - 5)
    _set_job(job_id, status="running", started_at=now - 10, total_steps=100, step=60)
    eta = runs._eta(jobs.get_job(job_id), now)
    assert eta == pytest.approx(40.0, rel=0.01)
    assert "ETA 0:4" in runs.progress_text(jobs.get_job(job_id))  # 0:40, and the seconds this test took


def _enabled(out: dict[str, object]) -> set[str]:
    return {a for a in runs.ACTIONS if out[a]["interactive"]}  # type: ignore[index]


def test_buttons_follow_the_selected_runs_status() -> None:
    assert _enabled(runs.refresh(None, {})) == set()
    job_id = jobs.submit(CONFIG, start=False)
    expected = {"queued": {"pause", "cancel", "delete"}, "running": {"pause", "cancel"},
                "interrupted": {"resume", "delete"}, "failed": {"resume", "delete"},
                "cancelled": {"resume", "delete"}, "completed": {"delete"}}
    for status, actions in expected.items():
        _set_job(job_id, status=status)
        assert _enabled(runs.refresh(job_id, {}, force=True)) == actions, status


def test_a_notice_stays_on_its_run_and_goes_when_it_has_finished(fake_engine: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    other = jobs.submit({**CONFIG, "max_steps": 2})
    jobs.wait(other, timeout=60)
    job_id = jobs.submit({**CONFIG, "max_steps": 60})
    wait_for(lambda: jobs.get_job(job_id).step >= 1, what="a step")
    noted = runs.act_and_note("pause", job_id, False)
    assert "stopping" in noted["notice"] and noted["noticed"] == (job_id, "running")
    noticed = noted["noticed"]
    seen = runs.refresh(job_id, {}, noticed)["seen"]
    # Shown while its run is the one on screen and still stopping ...
    kept = runs.refresh(job_id, seen, noticed)
    assert not isinstance(kept["notice"], str) and not isinstance(kept["noticed"], tuple)  # both left as they are
    # ... gone when another run is picked,
    assert runs.refresh(other, dict(seen), noticed)["notice"] == ""
    # and gone once the run has stopped.
    jobs.wait(job_id, timeout=60)
    after = runs.refresh(job_id, seen, noticed)
    assert after["notice"] == "" and after["noticed"] is None
    noted = runs.act_and_note("resume", job_id, False)
    assert "queued again" in noted["notice"]
    noticed = noted["noticed"]
    wait_for(lambda: jobs.get_job(job_id).status == "running", what="the job running again")
    assert not isinstance(runs.refresh(job_id, seen, noticed)["notice"], str)
    jobs.wait(job_id, timeout=60)
    assert runs.refresh(job_id, seen, noticed)["notice"] == ""


def test_a_notice_goes_even_when_the_run_stopped_before_the_click_returned(fake_engine: None) -> None:
    """The status is the one before the action: a pause whose run was already interrupted when
    the notice was recorded (a fast engine, a slow machine) still leaves with its run."""
    job_id = jobs.submit({**CONFIG, "max_steps": 2})
    jobs.wait(job_id, timeout=60)
    done = jobs.get_job(job_id).status
    assert runs.refresh(job_id, {}, (job_id, "running"))["notice"] == ""
    assert not isinstance(runs.refresh(job_id, {}, (job_id, done))["notice"], str)  # nothing happened since


def test_a_poll_beside_the_click_leaves_the_notice_record_alone(fake_engine: None) -> None:
    """A poll that started before the click read no record: it must not write one back (the
    record is a state of its own, not part of the `seen` the poll returns)."""
    job_id = jobs.submit({**CONFIG, "max_steps": 2})
    jobs.wait(job_id, timeout=60)
    out = runs.refresh(job_id, {}, None)
    assert not isinstance(out["noticed"], tuple) and out["noticed"] is not None  # gr.skip(): untouched
    assert "notice" not in out["seen"]


def test_the_total_reward_is_not_hidden_under_an_identical_single_reward() -> None:
    steps = [1, 2, 3]
    frame = pd.DataFrame({"step": steps * 3, "value": [0.1, 0.5, 0.9] * 2 + [0.2, 0.1, 0.3],
                          "name": ["reward"] * 3 + ["reward/exact_answer"] * 3 + ["reward_std"] * 3})
    assert set(runs._without_twins(frame)["name"]) == {"reward", "reward_std"}
    two = pd.DataFrame({"step": steps * 3, "value": [0.3, 0.5, 0.7, 0.1, 0.5, 0.9, 0.5, 0.5, 0.5],
                        "name": ["reward"] * 3 + ["reward/a"] * 3 + ["reward/b"] * 3})
    assert set(runs._without_twins(two)["name"]) == {"reward", "reward/a", "reward/b"}
    job_id = jobs.submit(CONFIG, start=False)
    queries.write_metrics(job_id, [(s, n, v) for s, v, n in zip(frame["step"], frame["value"], frame["name"])])
    assert set(runs.chart_frames(jobs.get_job(job_id))["chart_reward"]["name"]) == {"reward", "reward_std"}


def test_a_run_started_from_the_command_line_is_listed_and_follows_the_runs_tab(
        fake_engine: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m kestrel train CONFIG` records its run in the store: the Runs tab lists it live
    with its charts, and its Stop button reaches the command line's process."""
    import subprocess
    import sys

    monkeypatch.setenv("FAKE_STEP_S", "0.1")
    config = tmp_path / "run.yaml"
    config.write_text("model: demo\ndataset: arithmetic_chat\nmax_steps: 300\nsave_steps: 5\nname: from-cli\n")
    proc = subprocess.Popen([sys.executable, "-m", "kestrel", "train", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: jobs.list_jobs() and jobs.list_jobs()[0].step >= 3, timeout=60, what="the run's steps")
        out = runs.refresh(None, {})
        job = jobs.list_jobs()[0]
        assert job.name == "from-cli" and out["table"].iloc[0, 2] == "running"
        assert len(out["chart_loss"]) >= 3 and out["pause"]["interactive"]
        runs.act("pause", job.id)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert f"recorded as job #{job.id}" in output and "interrupted" in output
    done = jobs.get_job(job.id)
    assert done.status == "interrupted" and done.step >= 3, (done.status, done.step)
    assert runs.refresh(job.id, {})["resume"]["interactive"]


def test_a_run_on_several_gpus_charts_each_gpus_peak_memory() -> None:
    job_id = jobs.submit(CONFIG, start=False)
    queries.write_metrics(job_id, [(1, "vram_peak_gib", 16.3), (1, "vram_peak_gib/gpu0", 16.3),
                                   (1, "vram_peak_gib/gpu1", 16.1), (1, "vram_alloc_gib/gpu1", 9.0)])
    names = set(runs.chart_frames(jobs.get_job(job_id))["chart_memory"]["name"])
    assert names == {"vram_peak_gib", "vram_peak_gib/gpu0", "vram_peak_gib/gpu1"}


def test_a_preference_runs_eval_rewards_and_kl_are_charted_beside_trainings() -> None:
    job_id = jobs.submit(CONFIG, start=False)
    train = [(s, n, 0.1 * s) for s in (1, 2) for n in ("rewards/chosen", "rewards/margins", "kl")]
    evals = [(2, n, 0.5) for n in ("eval_rewards/chosen", "eval_rewards/margins", "eval_rewards/accuracies",
                                   "eval_kl")]
    queries.write_metrics(job_id, train + evals + [(2, "eval_reward", 0.4), (2, "eval_reward/a", 0.4)])
    frames = runs.chart_frames(jobs.get_job(job_id))
    assert set(frames["chart_reward"]["name"]) == {"rewards/chosen", "rewards/margins", "eval_rewards/chosen",
                                                   "eval_rewards/margins", "eval_rewards/accuracies", "eval_reward"}
    assert set(frames["chart_kl"]["name"]) == {"kl", "eval_kl"}


def test_the_progress_line_names_the_best_weights_once_the_store_records_them(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "best" / "adapter").mkdir(parents=True)
    (run / "best" / "adapter" / "adapter_config.json").write_text("{}")
    (run / "best" / "best.json").write_text('{"step": 6, "metric": "eval_loss", "value": 0.6931}')
    job_id = jobs.submit({**CONFIG, "output_dir": str(run)}, start=False)
    assert "best weights" not in runs.progress_text(jobs.get_job(job_id))
    queries.record_artifact(job_id, "best", run / "best", 6)
    assert "best weights: eval_loss 0.6931 at step 6" in runs.progress_text(jobs.get_job(job_id))
