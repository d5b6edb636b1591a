"""Paths a studio user types stay inside KESTREL_HOME (issue 30, item 6): output folders below
`runs/`, datasets inside the home or the shipped samples; refused before anything is read or
created, with a message naming the field and no content of the file. Run names never become
paths outside the output folder, in the studio or the engine."""

from __future__ import annotations

import os
from pathlib import Path

import gradio as gr
import pytest

from kestrel import jobs
from kestrel.config import TrainConfig
from kestrel.errors import ConfigError
from kestrel.studio import files
from kestrel.studio.handlers import datasets as ds
from kestrel.studio.handlers import train
from kestrel.training.run import resolve_output_dir
from tests.studio.helpers import error_text, form

SECRET = "TOP-SECRET-LINE not json\n"


def _everything_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.mark.parametrize("output_dir", ["../../escaped", "../escaped", "/tmp/kestrel-escaped", "~/escaped", "."])
def test_output_dir_outside_runs_is_refused(output_dir: str, kestrel_home: Path, tmp_path: Path) -> None:
    before = _everything_under(tmp_path)
    extra, values = form(output_dir=output_dir)
    assert "output_dir" in train.preview(extra, *values)["status"]  # a notice while typing
    with pytest.raises(gr.Error) as excinfo:
        train.start_training(extra, *values)
    assert error_text(excinfo).startswith(f"output_dir {output_dir!r} is outside ")
    assert jobs.list_jobs() == []
    assert not Path("/tmp/kestrel-escaped").exists()
    assert {p for p in _everything_under(tmp_path) - before if "runs" in p.parts and p.name != "runs"} == set()


def test_a_relative_output_dir_goes_under_runs(kestrel_home: Path, fake_engine: None) -> None:
    extra, values = form(output_dir="my-run", max_steps=2)
    job = jobs.get_job(train.start_training(extra, *values)["job"])
    assert job.output_dir == str((kestrel_home / "runs" / "my-run").resolve())


def _secret_file(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "secret.jsonl"
    path.write_text(SECRET)
    return path


def test_datasets_outside_home_are_never_read(kestrel_home: Path, tmp_path: Path) -> None:
    secret = _secret_file(tmp_path / "elsewhere")
    inside = files.datasets_dir() / "link.jsonl"
    os.symlink(secret, inside)  # a link inside the home counts where it points
    for name in (str(secret), str(inside), "../../elsewhere/secret.jsonl", f"{kestrel_home}/../elsewhere/secret.jsonl"):
        with pytest.raises(gr.Error) as excinfo:
            ds.open_dataset(name)
        message = error_text(excinfo)
        assert message.startswith(f"dataset {name!r} is outside the studio's folder") and "TOP-SECRET" not in message
        extra, values = form(dataset=name)
        with pytest.raises(gr.Error) as excinfo:
            train.start_training(extra, *values)
        assert "is outside the studio's folder" in error_text(excinfo) and "TOP-SECRET" not in error_text(excinfo)
    assert jobs.list_jobs() == [] and jobs.list_datasets() == []


def test_datasets_inside_home_and_samples_still_open(kestrel_home: Path) -> None:
    (files.datasets_dir() / "mine.jsonl").write_text('{"prompt": "1 + 1?", "completion": "2"}\n')
    assert ds.open_dataset("mine.jsonl")["state"]["path"] == str(files.datasets_dir() / "mine.jsonl")
    assert ds.open_dataset("arithmetic_chat")["state"]["format"] == "messages"
    bad = files.datasets_dir() / "bad.jsonl"
    bad.write_text(SECRET)  # inside the home: its own problems are reported as before
    with pytest.raises(gr.Error) as excinfo:
        ds.open_dataset(str(bad))
    assert "bad.jsonl" in error_text(excinfo) and "line 1" in error_text(excinfo)


def test_local_models_and_adapters_outside_home_are_refused(kestrel_home: Path, tiny_model_dir) -> None:
    """A model folder elsewhere on the host could be trained on and its export downloaded."""
    outside = tiny_model_dir("llama")
    for changes, field in (({"model_source": "local", "model": str(outside)}, "model"),
                           ({"model_source": "local", "model": "../../elsewhere"}, "model"),
                           ({"lora__init_from": str(outside)}, "lora.init_from"),
                           ({"lora__init_from": "../../x"}, "lora.init_from")):
        extra, values = form(**changes)
        assert f"{field} " in train.preview(extra, *values)["status"]
        with pytest.raises(gr.Error) as excinfo:
            train.start_training(extra, *values)
        assert error_text(excinfo).startswith(f"{field} ") and "is outside the studio's folder" in error_text(excinfo)
    # The Datasets tab's token counts would read that model's tokenizer: the dataset opens without them.
    summary = ds.open_dataset("arithmetic_chat", model=str(outside))["summary"]
    assert "no token counts: model" in summary and "is outside the studio's folder" in summary
    assert jobs.list_jobs() == []


def test_a_local_model_inside_home_trains(kestrel_home: Path, tiny_model_dir, fake_engine: None) -> None:
    import shutil

    shutil.copytree(tiny_model_dir("llama"), kestrel_home / "models" / "tiny")
    extra, values = form(model_source="local", model="./tiny", max_steps=2)
    job = jobs.get_job(train.start_training(extra, *values)["job"])
    assert job.config["model"] == str((kestrel_home / "models" / "tiny").resolve())


@pytest.mark.parametrize("name", ["../../escaped", "a/b", "a\\b", "a\x00b", "..", "."])
def test_run_names_never_become_paths(name: str, kestrel_home: Path) -> None:
    extra, values = form(name=name)
    with pytest.raises(gr.Error) as excinfo:
        train.start_training(extra, *values)
    assert "name" in error_text(excinfo)
    with pytest.raises(ConfigError, match="name"):
        resolve_output_dir(TrainConfig(name=name))
    assert not (kestrel_home.parent / "escaped").exists() and not (kestrel_home / "escaped").exists()


def test_the_engine_keeps_an_odd_name_inside_runs(kestrel_home: Path) -> None:
    for name in ("...", " ..x", "~", "$HOME", "%2e%2e", "C:", "-rf"):
        out = resolve_output_dir(TrainConfig(name=name)).resolve()
        assert out.parent == (kestrel_home / "runs").resolve(), name


def test_the_command_line_keeps_its_own_choice(tmp_path: Path) -> None:
    """An absolute output_dir given outside the studio is the user's own choice."""
    out = resolve_output_dir(TrainConfig(output_dir=str(tmp_path / "anywhere")))
    assert out == tmp_path / "anywhere" and out.is_dir()
