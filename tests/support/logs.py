"""A training callback that keeps the run's log lines (`Callback.on_log`), for tests that read them."""

from __future__ import annotations

from kestrel.training.metrics import Callback


class Logs(Callback):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def on_log(self, message: str) -> None:
        self.lines.append(message)
