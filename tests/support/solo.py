"""Turns between the suite's parallel workers (pytest-xdist): a test marked `solo` runs while no
other test runs, so that its timings (the studio's answer times while a job trains) measure the
product, not a neighbour's load. Every other test shares the floor.

A reader-writer lock over two files that every worker of one run opens (`flock`):

- a shared turn takes `gate` for a moment, then `floor` shared;
- a solo turn takes `gate` and keeps it, then `floor` exclusively: it waits for the tests running
  now to end, and the gate stops new ones from starting meanwhile (no solo test waits forever).

Without xdist (one process) a turn is free.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class Turns:
    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.gate, self.floor = folder / "gate", folder / "floor"
        for path in (self.gate, self.floor):
            path.touch()

    @contextmanager
    def turn(self, solo: bool) -> Iterator[None]:
        """Hold the floor for one test: alone if `solo`, else beside other shared turns."""
        with open(self.gate, "rb") as gate, open(self.floor, "rb") as floor:
            fcntl.flock(gate, fcntl.LOCK_EX)
            try:
                fcntl.flock(floor, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
            finally:
                if not solo:
                    fcntl.flock(gate, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(floor, fcntl.LOCK_UN)
                if solo:
                    fcntl.flock(gate, fcntl.LOCK_UN)


def run_turns() -> Turns | None:
    """The turns of this xdist run (its workers share PYTEST_XDIST_TESTRUNUID), None without xdist."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return Turns(Path(tempfile.gettempdir()) / f"kestrel-turns-{run}") if run else None
