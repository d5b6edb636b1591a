"""tests.support.solo: a solo turn waits for the shared turns running and holds back new ones."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.support.solo import Turns


def test_a_solo_turn_runs_alone(tmp_path: Path) -> None:
    turns, events, lock = Turns(tmp_path), [], threading.Lock()

    def log(what: str) -> None:
        with lock:
            events.append(what)

    def take(name: str, solo: bool, hold_s: float) -> None:
        with turns.turn(solo):
            log(f"{name} in")
            time.sleep(hold_s)
            log(f"{name} out")

    first = threading.Thread(target=take, args=("shared-1", False, 0.6))
    first.start()
    time.sleep(0.2)
    alone = threading.Thread(target=take, args=("solo", True, 0.4))
    alone.start()
    time.sleep(0.2)  # the solo turn is waiting for shared-1 now; a newcomer must wait behind it
    late = threading.Thread(target=take, args=("shared-2", False, 0.1))
    late.start()
    for t in (first, alone, late):
        t.join(10)
    assert events == ["shared-1 in", "shared-1 out", "solo in", "solo out", "shared-2 in", "shared-2 out"]


def test_shared_turns_overlap(tmp_path: Path) -> None:
    turns, inside, most = Turns(tmp_path), [0], [0]
    lock = threading.Lock()

    def take() -> None:
        with turns.turn(False):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.3)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=take) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert most[0] == 3
