"""The Runs tab's "Check generations": a finished run's held-out prompts answered again in a
process of its own with the run's default weights (its best when kept), the result shown beside
the references; a run without held-out prompts, a running one and a crashing check process give
messages while the studio's process goes on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gradio as gr
import pytest

from kestrel import jobs
from kestrel.config import config_from_dict
from kestrel.jobs.queries import record_artifact
from kestrel.studio.handlers import generation, runs
from tests.jobs.exportkit import completed_run, lora_run
from tests.studio.helpers import error_text


def _run(folder: Path, **config: object) -> jobs.Job:
    lora_run(folder)
    config_from_dict({"model": "demo", "dataset": "arithmetic_chat", "output_dir": str(folder), **config}).save(
        folder / "config.yaml")
    job_id = completed_run(folder, folder.name)
    with jobs.session(immediate=True) as s:  # the job row carries the config the run trained with
        job = s.get(jobs.Job, job_id)
        job.config = {**job.config, **config}
    return jobs.get_job(job_id)


def test_check_generations_answers_the_held_out_prompts_in_a_subprocess(tmp_path: Path) -> None:
    job = _run(tmp_path / "evaluated", eval_split=0.05)
    assert runs.select_job(job.id, {})["check_generations"]["interactive"]  # finished, weights, held-out rows
    outs = list(generation.check_generations(job.id))
    assert outs[0]["check_generations"]["interactive"] is False and "held-out prompts" in outs[0]["generation_summary"]
    last = outs[-1]
    written = json.loads((Path(job.output_dir) / "generation_check.json").read_text())
    assert len(written["rows"]) == 8 and last["generation_summary"].startswith("8 held-out prompts")
    table = last["generation_table"]
    assert table["reference"].tolist() == [r["reference"] for r in written["rows"]]
    assert table["ROUGE-L"].tolist() == [round(r["rouge_l"], 3) for r in written["rows"]]
    # The prompts are the run's held-out rows: the seeded split training made, never trained on.
    from kestrel.data import load_conversations
    from kestrel.data.split import split_rows

    _, convs, _ = load_conversations("arithmetic_chat")
    _, held = split_rows(convs, 0.05, config_from_dict({"model": "demo", "dataset": "arithmetic_chat"}).seed)
    assert [r["line"] for r in written["rows"]] == [c.line for c in held[:8]]


def test_the_check_uses_the_best_weights_when_the_store_lists_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    job = _run(tmp_path / "best", eval_split=0.05)
    shutil.copytree(Path(job.output_dir) / "adapter", Path(job.output_dir) / "best" / "adapter")
    (Path(job.output_dir) / "best" / "best.json").write_text('{"step": 3, "metric": "eval_loss", "value": 1.5}')
    record_artifact(job.id, "best", Path(job.output_dir) / "best", 3)
    seen: list[list[str]] = []
    monkeypatch.setattr(generation, "check_command", lambda *a: seen.append(list(map(str, a))) or [sys.executable, "-c", ""])
    list(generation.check_generations(job.id))
    assert seen == [[job.output_dir, str(Path(job.output_dir) / "best"), "3"]]


def test_a_crash_in_the_check_process_is_reported_and_the_studio_goes_on(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    job = _run(tmp_path / "crash", eval_split=0.05)
    # What a segfault in native decode code does to the process that runs it.
    monkeypatch.setattr(generation, "check_command",
                        lambda *a: [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    with pytest.raises(gr.Error) as excinfo:
        list(generation.check_generations(job.id))
    assert f"run #{job.id} failed (its process ended with SIGSEGV)" in error_text(excinfo)


def test_runs_that_cannot_be_checked_say_why(tmp_path: Path) -> None:
    plain = _run(tmp_path / "plain")
    assert not runs.select_job(plain.id, {})["check_generations"]["interactive"]
    with pytest.raises(gr.Error) as excinfo:
        list(generation.check_generations(plain.id))
    assert "no held-out prompts" in error_text(excinfo) and "eval_split" in error_text(excinfo)
    running = _run(tmp_path / "running", eval_split=0.05)
    with jobs.session(immediate=True) as s:
        s.get(jobs.Job, running.id).status = "running"
    with pytest.raises(gr.Error) as excinfo:
        list(generation.check_generations(running.id))
    assert "is running" in error_text(excinfo)
    with pytest.raises(gr.Error) as excinfo:
        list(generation.check_generations(None))
    assert "Pick a run first" in error_text(excinfo)


def _written(folder: Path, rows: list[dict], **summary: object) -> jobs.Job:
    """A finished run whose generation_check.json holds `rows` and `summary`'s keys."""
    job = _run(folder, eval_split=0.05)
    data = {"step": 4, "exact_match": 0.0, "rouge_l": 0.25, **summary, "rows": rows}
    (folder / "generation_check.json").write_text(json.dumps(data))
    return job


def test_answers_cut_by_the_checks_time_budget_are_marked(tmp_path: Path) -> None:
    row = {"line": 1, "prompt": "2+2?", "reference": "4", "exact_match": False, "rouge_l": 0.5}
    job = _written(tmp_path / "cut", [{**row, "answer": "The ans", "finished": "time"},
                                      {**row, "answer": "4", "finished": "stop"}], seconds=1.5, stopped_early=1)
    view = generation.generation_view(job)
    assert view["generation_table"]["answer"].tolist() == ["The ans [cut: time budget]", "4"]
    summary = view["generation_summary"]
    assert summary.startswith("2 held-out prompts at step 4")
    assert "1 answers were cut at the check's time budget (1.5 s" in summary and "'Check generations'" in summary


def test_a_check_written_before_the_time_budget_reads_as_before(tmp_path: Path) -> None:
    row = {"line": 1, "prompt": "2+2?", "reference": "4", "answer": "The ans", "exact_match": False, "rouge_l": 0.5}
    view = generation.generation_view(_written(tmp_path / "old", [row]))
    assert view["generation_table"]["answer"].tolist() == ["The ans"]
    assert view["generation_summary"] == "1 held-out prompts at step 4: exact match **0%**, ROUGE-L **0.250**"
