"""The Runs tab in a real Chromium, against `python app.py` with the fake engine (tests/jobs/fake_engine.py):
the Train form's GPU picker on a machine without one; charts numeric and drawn from the first run
of a fresh page; the log box following its end; the action buttons enabled by the run's status; a
notice that leaves with its run; the empty GPU memory chart of a CPU run saying why.
Screenshots land in test-artifacts/studio/runs-*.png.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kestrel import jobs
from tests.studio.browser_kit import (
    ARTIFACTS, NEEDS_CHROMIUM, TEXT, chromium_page, choose as _choose, fake_engine_env, shot, studio,
    wait_text as _wait_text,
)

SHARED_HOME = True

pytestmark = [pytest.mark.browser, pytest.mark.slow, NEEDS_CHROMIUM]


@pytest.fixture(scope="module")
def fake_server(module_home: Path) -> Iterator[str]:
    """`python app.py` whose jobs run the fake engine, 0.2 s a step."""
    with studio(module_home, ARTIFACTS / "app-runs.log", fake_engine_env(0.2)) as url:
        yield url


def _plot_types(body: bytes) -> list[dict[str, str]]:
    """The `datatypes` of every plot value in a Gradio response (JSON or server-sent events)."""
    found: list[dict[str, str]] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("datatypes"), dict) and "step" in node["datatypes"]:
                found.append(node["datatypes"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for chunk in body.decode("utf-8", "replace").split("\n"):
        chunk = chunk.removeprefix("data:").strip()
        if chunk.startswith(("{", "[")):
            try:
                walk(json.loads(chunk))
            except ValueError:
                continue
    return found


LOG = "document.querySelector('#ru-log textarea')"


def _disabled(pg: object, name: str) -> bool:
    return pg.evaluate(f"() => document.querySelector('#ru-{name}').disabled")  # type: ignore[attr-defined]


def _collect(types: list[dict[str, str]], request: object) -> None:
    if "gradio_api" not in request.url:  # type: ignore[attr-defined]
        return
    try:
        response = request.response()  # type: ignore[attr-defined]
        types.extend(_plot_types(response.body()) if response else [])
    except Exception:  # noqa: BLE001 - a stream the page closed has no body to read
        pass


def _walk(pg: Any, url: str) -> None:
    """The Train form's GPU picker, then the Runs tab through one run: start, charts, log, Stop."""
    pg.goto(url)
    # No GPU here: the memory estimate is for a card picked from the list.
    pg.get_by_role("tab", name="Train").click()
    _choose(pg, "#tr-gpu", "NVIDIA GeForce RTX 4090")
    _wait_text(pg, "#tr-vram", "for the card you picked")
    assert "RTX 4090" in pg.locator("#tr-vram").inner_text()
    # A fresh page with no run yet, then the first run: the charts it is sent are numeric throughout.
    pg.get_by_role("tab", name="Runs").click()
    _wait_text(pg, "#ru-progress", "No runs yet")
    assert all(_disabled(pg, a) for a in ("pause", "resume", "cancel", "delete"))
    job_id = jobs.submit({"model": "demo", "dataset": "arithmetic_chat", "max_steps": 400, "save_steps": 5})
    pg.wait_for_function(f"() => /step [1-9]/.test({TEXT}('#ru-progress'))", timeout=120_000)
    # The first run's loss is drawn as a line (the chart built on the empty page knew no series).
    pg.wait_for_function("() => [...document.querySelectorAll('#chart-loss g.mark-line path')].some(p =>"
                         " (p.getAttribute('d') || '').split(/[LM]/).length > 3 && p.getAttribute('stroke'))",
                         timeout=60_000)
    # 60 s, as the first wait's budget: on a loaded machine (the suite's other workers) the memory chart's
    # first draw took over 20 s once (session 41), though it takes a few seconds alone
    pg.wait_for_function("() => (document.querySelector('#chart-memory') || {}).textContent"
                         ".includes('trains on the CPU')", timeout=60_000)
    # Buttons: stop and cancel a running run; resume and delete it only once it has stopped.
    pg.wait_for_function("() => !document.querySelector('#ru-pause').disabled")
    assert _disabled(pg, "resume") and _disabled(pg, "delete") and not _disabled(pg, "cancel")
    # The log box follows its end as lines arrive.
    log_path = Path(jobs.get_job(job_id).log_path)
    with open(log_path, "a") as f:
        f.writelines(f"test line {i}\n" for i in range(80))
    pg.wait_for_function(f"() => {LOG}.value.includes('test line 79')")
    follows = (f"() => {{ const t = {LOG};"
               " return t.scrollHeight > t.clientHeight && t.scrollTop + t.clientHeight >= t.scrollHeight - 4; }")
    pg.wait_for_function(follows, timeout=10_000)
    with open(log_path, "a") as f:
        f.writelines(f"more line {i}\n" for i in range(30))
    pg.wait_for_function(f"() => {LOG}.value.includes('more line 29')")
    pg.wait_for_function(follows, timeout=10_000)
    shot(pg, "runs-01-running")
    # Stop: the notice stays while this run stops, and leaves once it has.
    # The fake engine stops within a step (0.2 s), maybe before a poll could see the notice: an
    # observer records every text the notice shows.
    pg.evaluate("() => { window.notices = []; const n = document.querySelector('#ru-notice');"
                " new MutationObserver(() => window.notices.push(n.innerText))"
                ".observe(n, {subtree: true, childList: true, characterData: true}); }")
    pg.locator("#ru-pause").click()
    _wait_text(pg, "#ru-progress", "interrupted")
    assert any(f"Job #{job_id}: stopping" in t for t in pg.evaluate("() => window.notices")), pg.evaluate(
        "() => window.notices")
    pg.wait_for_function(f"() => {TEXT}('#ru-notice').trim() === ''", timeout=10_000)
    pg.wait_for_function("() => !document.querySelector('#ru-resume').disabled")
    assert _disabled(pg, "pause") and _disabled(pg, "cancel") and not _disabled(pg, "delete")
    shot(pg, "runs-02-stopped")


def test_runs_tab(fake_server: str, module_home: Path, fake_engine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.2")  # this process schedules too (each jobs call may start a worker)
    types: list[dict[str, str]] = []
    with chromium_page(height=1400) as pg:
        pg.on("requestfinished", lambda r: _collect(types, r))
        try:
            _walk(pg, fake_server)
        except Exception:
            shot(pg, "runs-failed")
            raise
    assert types, "no chart data reached the page"
    wrong = [t for t in types if t.get("step") != "quantitative" or t.get("value") != "quantitative"]
    assert not wrong, f"charts sent with non-numeric axes: {wrong[:3]}"
    assert b"Traceback" not in (ARTIFACTS / "app-runs.log").read_bytes(), "the server logged a traceback"
