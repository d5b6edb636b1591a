"""Hostile configs at `jobs submit` (issue 30): refused with one line and nothing stored (no
orphan queued job), checked at submit rather than minutes later in the worker; and a seeded fuzz
of malformed configs through `load_config` and the command line."""

from __future__ import annotations

import math
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
from tests.support.hostile import alias_bomb


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

_KEYS = ["model", "method", "dataset", "output_dir", "name", "max_seq_length", "max_steps", "epochs", "learning_rate",
         "batch_size", "grad_accum", "packing", "gradient_checkpointing", "save_steps", "seed", "dtype",
         "warmup_steps", "lr_scheduler", "weight_decay", "max_grad_norm", "logging_steps", "dataset_format",
         "columns", "system_prompt", "fast_kernels", "lora", "grpo", "performance", "lora.r", "lora.alpha",
         "lora.targets", "lora.dropout", "lora.init_from", "grpo.num_generations", "grpo.top_p", "grpo.beta",
         "grpo.temperature", "grpo.num_iterations", "grpo.rewards", "grpo.loss_type", "performance.cuda_graphs",
         "performance.offload_gate", "columns.prompt"]


def _values(rng: random.Random, tmp: Path) -> list[Any]:
    return ["many", "", "off", "on", None, True, False, 0, -1, 1, 3.5, -0.0, 2**31, 2**63, 2**80, -(2**70), 10**30,
            1e12, 1e308, math.nan, math.inf, -math.inf, [1, 2], ["q_proj", 5], [], {}, {"a": {"b": 1}},
            [{"name": "exactly"}], [{"name": "format_regex", "pattern": "(x"}], [{"name": "exact_answer",
                                                                                    "weight": math.nan}],
            "a\x00b", "x" * rng.choice([241, 300, 5000]), "../../etc", str(tmp / "afile"), "/dev/null",
            "line\nbreak", "~nobody-xyz/run", "someone/model", "demo", "arithmetic_prompts", "xml", "grpo",
            "\u202e\u0000", "😀" * 40, {"prompt": 5}]


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        node = data.get(part)
        if not isinstance(node, dict):
            node = data[part] = {}
        data = node
    data[last] = value


def _text_mutation(rng: random.Random, text: str) -> str | bytes:
    kind = rng.randrange(9)
    if kind == 0:
        return text[: rng.randrange(len(text))]  # cut anywhere
    if kind == 1:
        return text + "lora: " + "[" * rng.choice([19, 21, 60, 5000]) + "\n"
    if kind == 2:
        return alias_bomb() if rng.random() < 0.5 else text + "lora: &x {targets: *x}\n"
    if kind == 3:
        return rng.randbytes(rng.randrange(1, 2048))
    if kind == 4:
        cut = rng.randrange(len(text))
        return text.encode()[:cut] + rng.randbytes(rng.randrange(1, 16)) + text.encode()[cut:]
    if kind == 5:
        line = rng.choice([line for line in text.splitlines() if ":" in line])
        return text + line + "\n"  # a duplicated key
    if kind == 6:
        return rng.choice(["- a\n- b\n", "42\n", "'text'\n", "~\n", "!!binary aGVsbG8=\n", "? [a]\n: b\n", "a: !!set {x}\n"])
    if kind == 7:
        return text + "seed: " + "9" * rng.choice([19, 400, 5000]) + "\n"
    return text + rng.choice(["grpo:\n  rewards:\n    - name: format_regex\n      pattern: '['\n",
                              "max_steps: 1e12\n", "epochs: .inf\n", "weight_decay: .nan\n", "lora: {alpha: 1e30}\n",
                              "gradient_checkpointing: off\n", "name: " + "r" * 250 + "\n", "<<: *nope\n"])


def _mutant(rng: random.Random, base: dict[str, Any], tmp: Path) -> str | bytes:
    if rng.random() < 0.35:
        return _text_mutation(rng, yaml.safe_dump(base, sort_keys=False))
    data = yaml.safe_load(yaml.safe_dump(base))
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.25 and data:
            data.pop(rng.choice(sorted(data)))
        else:
            _set(data, rng.choice(_KEYS), rng.choice(_values(rng, tmp)))
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=rng.random() < 0.5)


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
        content = _mutant(rng, base, tmp_path)
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
