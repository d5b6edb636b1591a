"""Hostile configs at `jobs submit` (issue 30): refused with one line and nothing stored (no
orphan queued job), checked at submit rather than minutes later in the worker; and a seeded fuzz
of malformed configs through `load_config` and the command line."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import text

from jobkit import config
from kestrel import jobs
from kestrel.cli.jobs import main as jobs_main
from kestrel.config import load_config
from kestrel.errors import ConfigError, KestrelError
from kestrel.jobs import queries, store
from kestrel.paths import ASSETS
from kestrel.safe_yaml import MAX_BYTES
from tests.support.hostile import alias_bomb, config_mutant


def _submit_cli(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = jobs_main(["submit", str(path), "--no-start", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def _job_count() -> int:
    return len(queries.list_jobs())


def _integrity() -> str:
    with store.get_engine().connect() as conn:
        return conn.execute(text("PRAGMA integrity_check")).scalar_one()


def test_bad_configs_at_submit_leave_the_job_table_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"output_dir": str(afile)}, "is a file (or a device), not a folder"),
        ({"output_dir": "/dev/null"}, "is a file"),
        ({"output_dir": str(afile / "run")}, "cannot be created"),
        ({"output_dir": "a\x00b"}, "NUL"),
        ({"output_dir": "x" * 300}, "over 255 bytes"),
        ({"max_steps": 2**63}, "max_steps"),
        ({"dataset": str(tmp_path / "gone.jsonl")}, "does not exist"),
        ({"eval_dataset": str(tmp_path / "gone-val.jsonl")}, "eval_dataset"),
        ({"eval_split": 0.9}, "eval_split"),
        ({"dataset_format": "xml"}, "dataset_format"),
        ({"model": str(tmp_path / "no-model")}, "does not exist"),
        ({"model": str(tmp_path)}, "has no config.json"),
        ({"model": "not a hub id!"}, "neither a local folder nor a Hugging Face hub id"),
        ({"model": "someone/not-cached"}, "HF_HUB_OFFLINE"),
        ({"lora": {"init_from": str(tmp_path / "none")}}, "lora.init_from"),
        ({"method": "grpo", "grpo": {"allow_custom_rewards": True,
                                     "rewards": [{"name": "custom", "path": str(tmp_path / "r.py")}]}}, "r.py"),
    ]
    for overrides, needle in cases:
        with pytest.raises(KestrelError, match=None) as err:
            jobs.submit(config(**overrides))
        assert needle in str(err.value), (overrides, str(err.value))
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(config(**overrides)))
        code, out, err_text = _submit_cli(path, capsys)
        assert code in (1, 2) and out == "" and err_text.startswith("error: "), err_text
        assert err_text.count("\n") == 1 and "Traceback" not in err_text
    assert jobs.list_jobs() == []
    assert not (Path(store.db_path()).parent / "runs").exists() or not any((store.db_path().parent / "runs").iterdir())


def test_a_bad_config_file_at_the_command_line_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {"bomb.yaml": alias_bomb().encode(), "list.yaml": b"- 1\n- 2\n", "scalar.yaml": b"42\n",
             "latin1.yaml": b"name: caf\xe9\n", "binary.yaml": bytes(range(256)),
             "deep.yaml": b"a: " + b"[" * 5000 + b"]" * 5000, "big.yaml": b"# " + b"x" * MAX_BYTES + b"\n",
             "epochs.yaml": b"model: demo\nepochs: .inf\n", "seed.yaml": b"seed: 1208925819614629174706176\n"}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        started = time.perf_counter()
        code, out, err = _submit_cli(path, capsys)
        assert time.perf_counter() - started < 1.0, name
        assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (name, err)
    assert jobs.list_jobs() == []
    ok = tmp_path / "ok.yaml"
    ok.write_text("model: demo\ndataset: arithmetic_chat\nmax_steps: 2\ngradient_checkpointing: off\n")
    code, out, _ = _submit_cli(ok, capsys)
    assert code == 0 and jobs.get_job(int(out)).config["gradient_checkpointing"] == "off"


def test_export_configs_with_hostile_values_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for content in ("kind: export\nsource: '²'\n", f"kind: export\nsource: {'9' * 30}\n",
                    "kind: export\nsource: demo\noutput_dir: /dev/null\n", "kind: export\nsource: ~nobody-xyz/x\n",
                    f"kind: export\nsource: demo\nname: {'n' * 300}\n"):
        path = tmp_path / "export.yaml"
        path.write_text(content)
        code, out, err = _submit_cli(path, capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (content, err)
    assert jobs.list_jobs() == []


# --- the fuzz ------------------------------------------------------------------------------------

def _check_load(path: Path) -> bool:
    """load_config gives a config or a one-line KestrelError, never anything else."""
    try:
        load_config(path)
    except KestrelError as exc:
        assert "\n" not in str(exc), str(exc)
        return False
    return True


def test_fuzzed_configs_give_a_config_or_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # `~` in a mutant never reaches the real home
    (tmp_path / "afile").write_text("x")
    base = yaml.safe_load((ASSETS / "configs" / "demo_sft.yaml").read_text())
    base.pop("output_dir")  # each job gets its own folder under KESTREL_HOME
    rng, started, outcomes = random.Random(30), time.perf_counter(), {"config": 0, "refused": 0, "queued": 0}
    for case in range(150):
        content = config_mutant(rng, base, tmp_path)
        path = tmp_path / f"case-{case}.yaml"
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
        valid = _check_load(path)
        before = _job_count()
        code, out, err = _submit_cli(path, capsys)
        assert "Traceback" not in out + err, (case, content)
        if code == 0:
            assert valid and out.strip().isdigit() and _job_count() == before + 1, (case, content, err)
            outcomes["queued"] += 1
        else:
            assert code in (1, 2) and out == "" and err.startswith("error: ") and err.count("\n") == 1, (case, err)
            assert _job_count() == before, (case, content)
            outcomes["refused"] += 1
        outcomes["config"] += valid
    assert outcomes["queued"] >= 10 and outcomes["refused"] >= 100, outcomes
    assert _integrity() == "ok"
    listed = time.perf_counter()
    assert jobs_main(["list"]) == 0 and time.perf_counter() - listed < 2.0
    capsys.readouterr()
    assert time.perf_counter() - started < 30.0


def test_submit_stores_nothing_when_the_output_folder_cannot_be_made(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder that fails to be created at the last moment (after every check) rolls the job back."""
    from kestrel.jobs import runner

    target, real_mkdir = tmp_path / "run", Path.mkdir

    def refuse(self: Path, *args: Any, **kwargs: Any) -> None:
        if self == target:
            raise PermissionError(13, "Permission denied")
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(ConfigError, match="cannot be created: Permission denied"):
        runner.submit(config(output_dir=str(target)), start=False)
    assert jobs.list_jobs() == []
