"""Studio tests: each test gets its own KESTREL_HOME (a module that sets SHARED_HOME = True shares
one across its tests, to build a model once), the CPU as the only device, and no leftover
workers afterwards. `fake_engine` swaps in tests/jobs/fake_engine.py for fast, model-free runs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel.jobs import runner, store
from tests.jobs.jobkit import stop_workers

JOBS_TESTS = Path(__file__).resolve().parent.parent / "jobs"


@pytest.fixture(scope="module")
def module_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("studio-home")


@pytest.fixture(autouse=True)
def kestrel_home(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    shared = getattr(request.module, "SHARED_HOME", False)
    home = request.getfixturevalue("module_home") if shared else tmp_path / "home"
    monkeypatch.setenv("KESTREL_HOME", str(home))
    monkeypatch.setenv("KESTREL_DEVICES", "cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("KESTREL_ENGINE_ENTRY", raising=False)
    monkeypatch.setattr(runner, "_last_refresh", 0.0)
    store.reset_engines()
    yield home
    stop_workers()
    store.reset_engines()


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs run tests/jobs/fake_engine.py: the engine's contract, no model, FAKE_STEP_S a step."""
    monkeypatch.setenv("KESTREL_ENGINE_ENTRY", "fake_engine:run")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(JOBS_TESTS), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FAKE_STEP_S", "0.05")
    monkeypatch.delenv("FAKE_FAIL", raising=False)

