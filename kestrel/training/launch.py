"""Start the other ranks of a run on several devices, and watch them.

The process asked to train becomes rank 0 and starts ranks 1..N-1 as child processes
(`python -m kestrel.training.rank <config.yaml>`) with torchrun's environment variables. Each
child writes its output to `rank-<r>.log` in the run folder, ignores SIGTERM (a cancel reaches
it through rank 0, which stops every rank at the same step) and exits when rank 0's process is
gone. A watchdog thread in rank 0 notices a child that died and reports which rank, on which
device, with the end of its log; rank 0's next collective then fails too, and the run ends
`failed` with that message.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from kestrel.constants import signal_name
from kestrel.training.distributed import World

POLL_S = 0.5
STUCK_GRACE_S = 30.0  # after a rank died: how long rank 0 may stay blocked before it is ended


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


class RankGroup:
    """Ranks 1..N-1 of a run, started from rank 0; `failure` is set when one of them died."""

    def __init__(self, config_path: Path, devices: list[str], output_dir: Path) -> None:
        self.devices, self.output_dir = devices, output_dir
        self.port = free_port()
        self.failure: str | None = None
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        for rank in range(1, len(devices)):
            self.children[rank] = self._start(rank, config_path)
        self._done = threading.Event()
        self._watch = threading.Thread(target=self._watchdog, name="kestrel-ranks", daemon=True)

    def world(self) -> World:
        """Rank 0's world, with the process group's rendezvous set in this process's environment."""
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port)})
        return World(0, len(self.devices), self.devices[0])

    def _start(self, rank: int, config_path: Path) -> subprocess.Popen[bytes]:
        device = self.devices[rank]
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(self.devices)), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(self.port), LOCAL_RANK=device.split(":")[1] if ":" in device else str(rank),
                   PYTHONUNBUFFERED="1")
        with open(self.log_path(rank), "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "kestrel.training.rank", str(config_path), str(os.getpid())],
                                    env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def log_path(self, rank: int) -> Path:
        return self.output_dir / f"rank-{rank}.log"

    def start_watching(self, on_stuck: Callable[[str], None]) -> None:
        """Watch the children; `on_stuck(message)` runs when a rank died and rank 0 is still
        running STUCK_GRACE_S later (blocked in a collective that will never finish)."""
        self._on_stuck = on_stuck
        self._watch.start()

    def _watchdog(self) -> None:
        died_at = None
        while not self._done.wait(POLL_S):
            if self.failure is None:
                self.failure = self._dead_child()
                died_at = time.monotonic() if self.failure else None
            elif died_at is not None and time.monotonic() - died_at > STUCK_GRACE_S:
                self._on_stuck(self.failure)
                return

    def _dead_child(self) -> str | None:
        for rank, proc in self.children.items():
            code = proc.poll()
            if code not in (None, 0):
                how = f"was killed by {signal_name(code)}" if code < 0 else f"exited with code {code}"
                tail = _tail(self.log_path(rank))
                return (f"rank {rank} (on {self.devices[rank]}) {how}; the whole run stops. "
                        f"Its log {self.log_path(rank)} ends: {tail or '(empty)'}")
        return None

    def wait_for_failure(self, timeout: float = 3.0) -> str | None:
        """Why a rank died, waiting up to `timeout` for the watchdog to see it (rank 0's collective
        can fail a moment before the dead child is reaped); None when every rank still runs."""
        deadline = time.monotonic() + timeout
        while self.failure is None and time.monotonic() < deadline:
            self.failure = self._dead_child()
            if self.failure is None:
                time.sleep(0.1)
        return self.failure

    def finish(self, timeout: float = 60.0) -> None:
        """Wait for the children to exit after the run (they end with rank 0), then kill any left."""
        self._done.set()
        deadline = time.monotonic() + timeout
        for proc in self.children.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        self._done.set()
        for proc in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
