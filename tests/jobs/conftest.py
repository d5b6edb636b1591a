"""Every jobs test gets its own KESTREL_HOME, the CPU as its only device and the fake engine
(tests/jobs/fake_engine.py) unless it asks for the real one; leftover workers are killed after."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel.jobs import runner, store
from tests.jobs.jobkit import stop_workers

HERE = Path(__file__).resolve().parent
# The helpers (jobkit) and the fake engine import by bare name, in the tests and in the workers
# (whose PYTHONPATH gets this folder below); pytest's import mode does not put it on sys.path.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture(autouse=True)
def kestrel_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    home = tmp_path / "home"
    monkeypatch.setenv("KESTREL_HOME", str(home))
    monkeypatch.setenv("KESTREL_DEVICES", "cpu")
    monkeypatch.setenv("KESTREL_ENGINE_ENTRY", "fake_engine:run")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FAKE_STEP_S", "0.02")
    for name in ("FAKE_FAIL", "KESTREL_CANCEL_TIMEOUT_S", "KESTREL_KILL_GRACE_S", "KESTREL_JOBS_PER_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runner, "_last_refresh", 0.0)
    store.reset_engines()
    yield home
    stop_workers()
    store.reset_engines()

