"""The fuzz suite of issue 30: malformed datasets and configs through every entry point a user
touches: the studio's upload, open, YAML box, YAML file button and Start (hostile paths), the
command line's `train` and `jobs submit`. Seeded (a failure names its case, to replay it); each
test stays well under a minute on the CPU.

Every case must end in a result or a message: no crash (everything runs in this process: a
native crash in a reader would end the test run), no hang (a per-case time limit), no raw
traceback (no exception other than the entry point's own user error; the studio never answers
"Something went wrong"), a message that names the file or the field, nothing written outside
its place (the studio: inside KESTREL_HOME; the command line: the run's own output folder), and
the job store's integrity check passes at the end. The reader's own fuzz is in
tests/data/test_reader.py, the submit fuzz of configs in tests/jobs/test_submit_hostile.py.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import gradio as gr
import pytest
import yaml
from sqlalchemy import text

from kestrel import jobs
from kestrel.cli import main as cli_main
from kestrel.cli.jobs import main as jobs_main
from kestrel.config import TrainConfig
from kestrel.jobs import runner, store
from kestrel.paths import ASSETS
from kestrel.studio import files
from kestrel.studio import strings as S
from kestrel.studio.handlers import datasets as ds
from kestrel.studio.handlers import train
from tests.studio.helpers import form
from tests.support.hostile import config_mutant, config_values, dataset_base, dataset_mutant

CASE_LIMIT_S = 10.0  # one case, any entry point: far past the slowest honest answer
UNEXPECTED = S.ERR_UNEXPECTED.split("(")[0]  # the studio's answer to an exception it did not foresee


def _keys(data: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, value in data.items():
        out |= {key, prefix + key}
        if isinstance(value, dict) and key in ("lora", "grpo", "performance"):
            out |= _keys(value, f"{prefix}{key}.")
    return out


FIELDS = _keys(TrainConfig().to_dict()) | {"config", "YAML", "rewards"}


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def _integrity() -> str:
    with store.get_engine().connect() as conn:
        return conn.execute(text("PRAGMA integrity_check")).scalar_one()


class Cases:
    """Runs cases, timing each and collecting every failed expectation (all reported at once)."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.count = 0

    def run(self, label: str, fn: Any, *args: Any) -> tuple[Any, BaseException | None]:
        self.count += 1
        started = time.perf_counter()
        try:
            result, error = fn(*args), None
        except (gr.Error, SystemExit) as exc:
            result, error = None, exc
        except Exception as exc:  # noqa: BLE001 - the point: it reaches the user as a traceback
            result, error = None, exc
            self.fail(label, f"raised {type(exc).__name__}: {str(exc)[:200]}")
        if time.perf_counter() - started > CASE_LIMIT_S:
            self.fail(label, f"took {time.perf_counter() - started:.1f} s")
        return result, error

    def fail(self, label: str, why: str) -> None:
        self.failures.append(f"{label}: {why}")

    def check(self) -> None:
        assert not self.failures, f"{len(self.failures)} of {self.count} cases failed:\n" + "\n".join(self.failures[:40])


def _studio_message(cases: Cases, label: str, error: BaseException | None, *names: str) -> None:
    """A studio refusal: a gr.Error the user can act on, naming one of `names`."""
    if error is None:
        return
    message = str(getattr(error, "message", error))
    if UNEXPECTED in message:
        cases.fail(label, f"unexpected error: {message}")
    elif not any(n in message for n in names):
        cases.fail(label, f"names none of {names[:3]}...: {message[:300]}")


def _cli_message(cases: Cases, label: str, code: Any, out: str, err: str, *names: str) -> None:
    """A command-line refusal: exit 1 or 2, last line `error: ...` naming one of `names`."""
    if "Traceback" in out + err:
        cases.fail(label, "printed a traceback")
    if code == 0:
        return
    last = (err.strip().splitlines() or [""])[-1]
    if code not in (1, 2) or not last.startswith("error: "):
        cases.fail(label, f"exit {code}, last line {last[:200]!r}")
    elif not any(n in last for n in names):
        cases.fail(label, f"names none of {names[:3]}...: {last[:300]}")


# --- datasets: upload, open, jobs submit, train --------------------------------------------------


def _dataset_cases(rng: random.Random, folder: Path, count: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(count):
        ext = rng.choice([".jsonl", ".jsonl", ".json", ".csv", ".parquet"] if i % 10 == 0 else [".jsonl", ".json", ".csv"])
        if ext == ".parquet":  # damaged Parquet: read in the reader's child process
            import pandas as pd

            good = folder / f"good{i}.parquet"
            pd.DataFrame([{"prompt": "What is 1 + 1?", "completion": "2"}] * 4).to_parquet(good)
            data = bytearray(good.read_bytes())
            good.unlink()
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data[: rng.randrange(8, len(data) + 1)])
        else:
            data = dataset_base(ext)
            for _ in range(rng.choice([1, 1, 2, 3])):
                data = dataset_mutant(rng, data)[1]
        path = folder / f"case-{i:03d}{ext}"
        path.write_bytes(data)
        out.append(path)
    return out


@pytest.mark.timeout(120)
def test_malformed_datasets_through_the_studio_and_submit(kestrel_home: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """100 damaged dataset files through upload, open and `jobs submit` (300 cases)."""
    monkeypatch.setattr(runner, "schedule", lambda: None)  # queued jobs stay queued: no workers
    rng, cases, opened = random.Random(3001), Cases(), {"rows": 0, "refused": 0}
    paths = _dataset_cases(rng, tmp_path / "inputs", 100)
    before = _files(tmp_path) - _files(kestrel_home)
    for path in paths:
        out, error = cases.run(f"upload {path.name}", ds.upload_dataset, str(path), 10)
        _studio_message(cases, f"upload {path.name}", error, path.name)
        if out is not None and not Path(out["state"]["path"]).is_relative_to(files.datasets_dir()):
            cases.fail(f"upload {path.name}", f"stored at {out['state']['path']}")
        inside = files.datasets_dir() / f"open-{path.name}"
        inside.write_bytes(path.read_bytes())
        _, error = cases.run(f"open {path.name}", ds.open_dataset, str(inside))
        _studio_message(cases, f"open {path.name}", error, inside.name)
        opened["refused" if error else "rows"] += 1
        config = tmp_path / "submit.yaml"
        config.write_text(yaml.safe_dump({"model": "demo", "dataset": str(path), "max_steps": 2}))
        code, _ = cases.run(f"submit {path.name}", jobs_main, ["submit", str(config), "--no-start"])
        captured = capsys.readouterr()
        _cli_message(cases, f"submit {path.name}", code, captured.out, captured.err, path.name)
    assert _files(tmp_path) - _files(kestrel_home) - {tmp_path / "submit.yaml"} == before
    assert {p.relative_to(kestrel_home).parts[0] for p in _files(kestrel_home)} <= {"datasets", "runs", "studio",
                                                                                       "kestrel.db", "kestrel.db-wal",
                                                                                       "kestrel.db-shm"}
    assert _integrity() == "ok"
    assert opened["rows"] >= 20 and opened["refused"] >= 20, opened  # both outcomes are exercised
    cases.check()


@pytest.mark.timeout(120)
def test_malformed_datasets_through_command_line_train(kestrel_home: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """10 damaged files trained for real (one step of the demo model): a result or one line."""
    rng, cases = random.Random(3002), Cases()
    paths = _dataset_cases(rng, tmp_path / "inputs", 10)
    monkeypatch.chdir(tmp_path)
    base = {"model": "demo", "max_steps": 1, "max_seq_length": 64, "gradient_checkpointing": "off", "save_steps": 0,
            "fast_kernels": False}
    for i, path in enumerate(paths):
        config = tmp_path / "train.yaml"
        config.write_text(yaml.safe_dump({**base, "dataset": str(path), "output_dir": str(tmp_path / "out" / str(i))}))
        code, _ = cases.run(f"train {path.name}", cli_main, ["train", str(config)])
        captured = capsys.readouterr()
        _cli_message(cases, f"train {path.name}", code, captured.out, captured.err, path.name)
    assert {p.relative_to(tmp_path).parts[0] for p in _files(tmp_path) - _files(kestrel_home)} <= {"inputs", "out",
                                                                                                    "train.yaml"}
    cases.check()


# --- configs: the YAML box, the YAML file button, command-line train -----------------------------


def _stub_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Configs that pass every check read their dataset, as the engine's first step does, and stop
    there (training itself is not what a config fuzz tests)."""
    from kestrel.data.formats import load_conversations
    from kestrel.training import grpo, sft

    def first_step(config: TrainConfig, output_dir: Path, cb: Any, *world: Any) -> tuple[str, int]:
        load_conversations(config.dataset, config.dataset_format, config.columns)
        return "completed", 0

    monkeypatch.setattr(sft, "run_sft", first_step)
    monkeypatch.setattr(grpo, "run_grpo", first_step)


@pytest.mark.timeout(120)
def test_malformed_configs_through_the_yaml_box_the_file_button_and_train(kestrel_home: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """120 damaged configs, each through the YAML box, the YAML file button and `python -m kestrel
    train` (360 cases). The studio keeps everything inside KESTREL_HOME; the command line writes
    only into the output folder of a run it accepted."""
    _stub_engine(monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))  # `~` in a mutant never reaches the real home
    cwd = tmp_path / "cwd" / "a" / "b"  # `../../x` from here stays inside tmp_path
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    (tmp_path / "afile").write_text("x")
    base = yaml.safe_load((ASSETS / "configs" / "demo_sft.yaml").read_text())
    base.pop("output_dir")
    rng, cases, accepted = random.Random(3003), Cases(), [kestrel_home]
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for case in range(120):
        content = config_mutant(rng, base, tmp_path)
        raw = content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass")
        path = inputs / f"case-{case:03d}.yaml"
        path.write_bytes(raw)
        box_text = raw.decode("utf-8", "replace")
        _, error = cases.run(f"YAML box {case}", train.apply_yaml, box_text)
        _studio_message(cases, f"YAML box {case}", error, "the YAML box", *FIELDS)
        _, error = cases.run(f"YAML file {case}", train.load_yaml_file, str(path))
        _studio_message(cases, f"YAML file {case}", error, path.name, *FIELDS)
        code, _ = cases.run(f"train {case}", cli_main, ["train", str(path)])
        captured = capsys.readouterr()
        _cli_message(cases, f"train {case}", code, captured.out, captured.err, path.name, *FIELDS)
        if code == 0:
            accepted.append(Path(captured.out.strip().rsplit("output in ", 1)[-1]))
    strays = [p for p in _files(tmp_path) if not any(p.is_relative_to(a) for a in [*accepted, inputs])
              and p != tmp_path / "afile"]
    assert strays == [], strays[:10]
    assert _integrity() == "ok"
    assert 10 <= len(accepted) <= 100, len(accepted)  # both outcomes are exercised
    cases.check()


# --- the Train form's paths: Start ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_hostile_paths_and_names_in_the_train_form(kestrel_home: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """100 forms with hostile output folders, datasets, adapters and run names pressed Start: a
    queued job inside KESTREL_HOME/runs reading files inside KESTREL_HOME or a sample, or a message
    naming the field; nothing created outside."""
    monkeypatch.setattr(runner, "schedule", lambda: None)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    cwd = tmp_path / "cwd" / "a" / "b"  # a relative path that escaped would land in tmp_path, not in the repo
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"prompt": "SECRET", "completion": "x"}\n')
    (tmp_path / "afile").write_text("x")
    rng, cases, outcomes = random.Random(3004), Cases(), {"queued": 0, "refused": 0}
    escapes = ["../../escaped", "../runs2", "/tmp", str(tmp_path / "escaped"), "~/escaped", "~", ".", "runs/../..",
               str(secret), "../secret.jsonl", "../../secret.jsonl", "run/../../../x", "ok-run", "nested/run"]
    before = _files(tmp_path) - _files(kestrel_home)
    for case in range(100):
        field = rng.choice(["output_dir", "dataset", "name", "lora.init_from"])
        value = rng.choice(escapes + [v for v in config_values(rng, tmp_path) if isinstance(v, str)])
        extra, values = form(**{field.replace(".", "__"): value})
        out, error = cases.run(f"Start {field}={value!r:.60}", train.start_training, extra, *values)
        if error is not None and "SECRET" in str(getattr(error, "message", error)):
            cases.fail(f"Start {field}={value!r:.60}", "the message shows the file's content")
        _studio_message(cases, f"Start {field}={value!r:.60}", error, field, "Dataset", "already started")
        if out is not None:
            job = jobs.get_job(out["job"])
            runs = (kestrel_home / "runs").resolve()
            if not Path(job.output_dir).resolve().is_relative_to(runs):
                cases.fail(f"Start {field}={value!r:.60}", f"output_dir {job.output_dir}")
            dataset = Path(job.config["dataset"]).resolve()
            if not (dataset.is_relative_to(kestrel_home.resolve()) or dataset.is_relative_to(ASSETS)):
                cases.fail(f"Start {field}={value!r:.60}", f"dataset {dataset}")
            init_from = job.config["lora"].get("init_from")
            if init_from and not Path(init_from).resolve().is_relative_to(kestrel_home.resolve()):
                cases.fail(f"Start {field}={value!r:.60}", f"lora.init_from {init_from}")
            runner.delete(job.id, remove_files=True)  # the next case may submit the same form
        outcomes["queued" if out is not None else "refused"] += 1
    assert outcomes["queued"] >= 10 and outcomes["refused"] >= 30, outcomes
    assert _files(tmp_path) - _files(kestrel_home) == before
    assert _integrity() == "ok"
    cases.check()
