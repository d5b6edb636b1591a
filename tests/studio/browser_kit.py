"""What the studio's browser tests share: `python app.py` on a free port with its own KESTREL_HOME,
Debian's Chromium driven by Playwright (flags from ../shared/docs/browser-notes.md), and the page
helpers (read an element's text, wait for it, pick a dropdown option as a user would)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.studio.helpers import wait_for

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "studio"
JOBS_TESTS = REPO / "tests" / "jobs"

NEEDS_CHROMIUM = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                    reason=f"{CHROMIUM} is missing: install it with `apt-get install -y chromium`")

TEXT = "((s) => (document.querySelector(s) || {}).innerText || '')"
VALUE = "((s) => (document.querySelector(s) || {}).value || '')"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_engine_env(step_s: float) -> dict[str, str]:
    """The environment that makes the studio's jobs run tests/jobs/fake_engine.py, `step_s` a step."""
    return {"KESTREL_ENGINE_ENTRY": "fake_engine:run", "FAKE_STEP_S": str(step_s),
            "PYTHONPATH": os.pathsep.join(p for p in (str(JOBS_TESTS), os.environ.get("PYTHONPATH")) if p)}


@contextmanager
def studio(home: Path, log_path: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """`python app.py` on a free port with KESTREL_HOME `home`, on the CPU, offline; yields its URL.
    The real engine runs jobs unless `env` names another (`fake_engine_env`)."""
    port = free_port()
    full = {**os.environ, "KESTREL_HOME": str(home), "KESTREL_DEVICES": "cpu", "HF_HUB_OFFLINE": "1"}
    full.pop("KESTREL_ENGINE_ENTRY", None)
    full.update(env or {})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--port", str(port)], cwd=REPO, env=full,
                                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/"

        def up() -> bool:
            try:
                return urllib.request.urlopen(url, timeout=2).status == 200
            except OSError:
                assert proc.poll() is None, f"app.py exited; see {log_path}"
                return False

        try:
            wait_for(up, timeout=120, what="app.py to serve")
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@contextmanager
def chromium_page(height: int = 1000, downloads: bool = False) -> Iterator[object]:
    """A Chromium page 1400 px wide, 60 s default timeout."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": height}, accept_downloads=downloads)
        pg.set_default_timeout(60_000)
        try:
            yield pg
        finally:
            browser.close()


def wait_text(pg: object, selector: str, part: str, timeout: float = 60_000) -> None:
    """Until the element's text contains `part` (the element may not exist yet)."""
    pg.wait_for_function(f"([s, p]) => {TEXT}(s).includes(p)", arg=[selector, part],  # type: ignore[attr-defined]
                         timeout=timeout)


def choose(pg: object, selector: str, prefix: str) -> None:
    """Pick the dropdown option whose label starts with `prefix`, as a user would."""
    pg.locator(f"{selector} input").click()  # type: ignore[attr-defined]
    pg.get_by_role("option", name=re.compile("^" + re.escape(prefix))).first.click()  # type: ignore[attr-defined]
    pg.wait_for_function(f"([s, p]) => {VALUE}(s).startsWith(p)", arg=[f"{selector} input", prefix])  # type: ignore[attr-defined]


def shot(pg: object, name: str, folder: Path = ARTIFACTS) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(folder / f"{name}.png"), full_page=True)  # type: ignore[attr-defined]
