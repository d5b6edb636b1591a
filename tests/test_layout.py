"""The house rules that a grep can prove: one installable package, the environment read in one
place, no per-run state in context variables or module globals of the training path, kernels that
never import transformers, and two training runs in one process that cannot see each other."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from kestrel.config import config_from_dict
from kestrel.training.run import run

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kestrel"
TRAINING_PATH = ("model", "recompute", "training", "data")


def _sources(*rooms: str) -> list[Path]:
    folders = [PACKAGE / r for r in rooms] if rooms else [PACKAGE]
    return sorted(p for f in folders for p in f.rglob("*.py"))


def test_the_repository_holds_one_package_and_no_stray_top_level_modules() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages <= {"kestrel", "tests", "bench"}, packages
    assert {p.name for p in ROOT.glob("*.py")} == {"app.py"}
    shadow = subprocess.run([sys.executable, "-c", "import kernels"], cwd=ROOT, capture_output=True, text=True)
    assert shadow.returncode != 0 and "No module named 'kernels'" in shadow.stderr


def test_kestrel_variables_are_read_only_in_kestrel_env() -> None:
    offenders = []
    for path in _sources():
        if path.name == "env.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("KESTREL_"):
                parent_calls = path.read_text().splitlines()[node.lineno - 1]
                if "environ" in parent_calls or "getenv" in parent_calls:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_no_context_variables_or_mutable_class_state_in_the_training_path() -> None:
    found = []
    for path in _sources(*TRAINING_PATH):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "ContextVar" or (
                    isinstance(node, ast.ImportFrom) and node.module == "contextvars"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} ContextVar")
            if isinstance(node, ast.ClassDef):
                for item in node.body:  # a class-level list/dict/set literal is shared by every instance
                    if isinstance(item, (ast.Assign, ast.AnnAssign)) and isinstance(item.value, (ast.List, ast.Dict, ast.Set)):
                        found.append(f"{path.relative_to(ROOT)}:{item.lineno} {node.name}")
    assert not found, found


def test_kernels_never_import_transformers_or_peft() -> None:
    for path in _sources("kernels"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("transformers", "peft") for n in names), path


def _cfg(model: str, out: Path, **kw) -> dict:
    base = dict(model=model, dataset="arithmetic_chat", output_dir=str(out), max_seq_length=64, batch_size=2,
                max_steps=6, learning_rate=1e-3, save_steps=0, seed=0)
    return {**base, **kw}


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_different_runs_in_one_process_each_get_their_own_result(tiny_model_dir, tmp_path: Path) -> None:
    """An offloaded llama run and a recomputed qwen3 run, back to back twice: each repeats its own
    losses exactly, whatever ran before it in the process."""
    a = _cfg(str(tiny_model_dir("llama")), tmp_path / "a1", gradient_checkpointing="offload",
             performance={"offload_gate": 1.0})
    b = _cfg(str(tiny_model_dir("qwen3")), tmp_path / "b1", gradient_checkpointing="standard", learning_rate=3e-3)
    for name, cfg in (("a1", a), ("b1", b), ("a2", a), ("b2", b)):
        assert run(config_from_dict({**cfg, "output_dir": str(tmp_path / name)})).status == "completed"
    assert _losses(tmp_path / "a1") == _losses(tmp_path / "a2")
    assert _losses(tmp_path / "b1") == _losses(tmp_path / "b2")
    assert _losses(tmp_path / "a1") != _losses(tmp_path / "b1")
    saved = (tmp_path / "a1" / "config.yaml").read_text()
    assert "performance:" in saved and "cuda_graphs: auto" in saved and "offload_gate: 1.0" in saved
