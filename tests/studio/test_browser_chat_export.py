"""Issue 29's Chat and Export page defects in a real Chromium against `python app.py`: a run that
appears after the page loaded becomes the default of Export and Chat, its weights can be
chosen, the demo model's note shows, Stop never leaves a panel on "Loading…", each answer shows
its tokens/s, and the quantization list carries size and quality hints.

The run is a LoRA adapter of the demo model written into the store by the test (no training):
the page must pick it up on its own. Screenshots land in test-artifacts/studio/chat-export-*.png.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel.studio import strings as S
from tests.studio.browser_kit import (
    ARTIFACTS, NEEDS_CHROMIUM, TEXT, VALUE, chromium_page, choose as _choose, studio, wait_text as _wait_text,
)

SHARED_HOME = True

pytestmark = [pytest.mark.browser, pytest.mark.slow, NEEDS_CHROMIUM]

LAST_BOT = "(p => { const b = document.querySelectorAll(p + ' .bot'); return b.length ? b[b.length - 1].innerText : ''; })"


@pytest.fixture(scope="module")
def server(module_home: Path) -> Iterator[str]:
    with studio(module_home, ARTIFACTS / "chat-export-app.log") as url:
        yield url


@pytest.fixture(scope="module")
def page(server: str) -> Iterator[object]:
    with chromium_page(height=1100) as pg:
        yield pg


def _shot(pg: object, name: str) -> None:
    pg.screenshot(path=str(ARTIFACTS / f"chat-export-{name}.png"), full_page=True)  # type: ignore[attr-defined]


def _value(pg: object, selector: str) -> str:
    return pg.evaluate(f"{VALUE}('{selector} input')")  # type: ignore[attr-defined]


def _wait_value(pg: object, selector: str, prefix: str) -> None:
    _wait_or_tell(pg, f"() => {VALUE}({selector + ' input'!r}).startsWith({prefix!r})", f"{selector} = {prefix!r}")


def _options(pg: object, selector: str) -> list[str]:
    """The option labels of a dropdown, as the user sees them when opening it."""
    pg.locator(f"{selector} input").click()  # type: ignore[attr-defined]
    pg.get_by_role("option").first.wait_for()  # type: ignore[attr-defined]  # the list opens after the click
    labels = [t.split("\n")[-1] for t in pg.get_by_role("option").all_inner_texts()]  # type: ignore[attr-defined]  # "✓\n" marks the chosen
    pg.keyboard.press("Escape")  # type: ignore[attr-defined]
    return labels


PAGE_STATE = """() => ({
  tab: document.querySelector('button[role=tab][aria-selected=true]')?.innerText,
  chat_target: document.querySelector('#ch-target input')?.value,
  chat_checkpoint: document.querySelector('#ch-checkpoint input')?.value,
  export_source: document.querySelector('#ex-source input')?.value,
  export_checkpoint: document.querySelector('#ex-checkpoint input')?.value ?? 'not on the page',
  export_quant: document.querySelector('#ex-quant input')?.value,
  left: document.querySelector('#ch-left')?.innerText.slice(-300),
  right: document.querySelector('#ch-right')?.innerText.slice(-300),
  message: document.querySelector('#ch-message textarea')?.value,
  send_disabled: document.querySelector('#ch-send')?.disabled,
  stats: document.querySelector('#ch-stats')?.innerText,
  toasts: [...document.querySelectorAll('.toast-body, [data-testid=toast-body]')].map(t => t.innerText),
})"""


def _wait_or_tell(pg: object, script: str, what: str, timeout: float = 60_000) -> None:
    """wait_for_function, failing with what the page showed instead (and a screenshot)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        pg.wait_for_function(script, polling=20, timeout=timeout)  # type: ignore[attr-defined]
    except PlaywrightTimeout:
        _shot(pg, "FAILED")
        log = (ARTIFACTS / "chat-export-app.log").read_text(errors="replace")[-1500:]
        pytest.fail(f"{what}: not within {timeout / 1000:.0f} s; the page showed {pg.evaluate(PAGE_STATE)}; "  # type: ignore[attr-defined]
                    f"the server log ends: {log}")


def _send(pg: object, text: str) -> None:
    pg.locator("#ch-message textarea").fill(text)  # type: ignore[attr-defined]
    pg.locator("#ch-send").click()  # type: ignore[attr-defined]


def _max_new(pg: object, n: int) -> None:
    box = pg.locator("#ch-max-new input[type=number]")  # type: ignore[attr-defined]
    box.fill(str(n))
    box.press("Enter")


def test_chat_and_export_follow_the_newest_run(page: object, server: str, module_home: Path) -> None:
    from tests.jobs.exportkit import checkpoint_in, finished_run_in

    pg = page
    pg.goto(server)  # type: ignore[attr-defined]
    pg.get_by_role("tab", name="Chat").click()  # type: ignore[attr-defined]
    _wait_value(pg, "#ch-target", "Base: demo")
    _wait_text(pg, "#ch-note", "gibberish")  # the demo model's note, before anyone is puzzled
    # A run finishes while the page is open (here: written into the store by the test).
    job = finished_run_in(module_home, "tuned")
    checkpoint_in(module_home / "runs" / "tuned", 1, -1.0)
    pg.get_by_role("tab", name="Export").click()  # type: ignore[attr-defined]
    _wait_value(pg, "#ex-source", f"Run #{job}")
    _wait_value(pg, "#ex-checkpoint", S.WEIGHTS_FINAL)
    quants = _options(pg, "#ex-quant")
    assert any(q.startswith("q4_k_m · up to ") and "recommended" in q for q in quants), quants
    assert any(q.startswith("f16 · about ") for q in quants), quants
    _shot(pg, "01-export")
    pg.get_by_role("tab", name="Chat").click()  # type: ignore[attr-defined]
    _wait_value(pg, "#ch-target", f"Run #{job}")
    _wait_value(pg, "#ch-checkpoint", S.WEIGHTS_FINAL)
    assert _options(pg, "#ch-checkpoint") == [S.WEIGHTS_FINAL, S.WEIGHTS_STEP.format(step=1)]
    _wait_text(pg, "#ch-note", "trained from the built-in demo model")
    # Side by side, Stop pressed while the answers are still loading: no panel stays "Loading…".
    pg.locator("#ch-side input").check()  # type: ignore[attr-defined]
    pg.wait_for_function("document.querySelector('#ch-right') !== null")  # type: ignore[attr-defined]
    pg.get_by_text("Sampling", exact=True).click()  # type: ignore[attr-defined]
    _max_new(pg, 2048)
    _send(pg, "Count to a thousand.")
    _wait_or_tell(pg, f"() => {LAST_BOT}('#ch-right').startsWith('Loading')", "the right panel's Loading…")
    pg.locator("#ch-stop").click()  # type: ignore[attr-defined]
    pg.wait_for_function("!document.querySelector('#ch-send').disabled", timeout=60_000)  # type: ignore[attr-defined]
    pg.wait_for_timeout(3000)  # type: ignore[attr-defined]
    _shot(pg, "02-stopped")
    for panel in ("#ch-left", "#ch-right"):
        last = pg.evaluate(f"{LAST_BOT}('{panel}')")  # type: ignore[attr-defined]
        assert not last.startswith("Loading"), f"{panel} stuck on {last!r} after Stop"
    # A short answer from both, each with its tokens/s.
    _max_new(pg, 12)
    _send(pg, "What is 2 + 3?")
    pg.wait_for_function(f"() => ({TEXT}('#ch-stats').match(/tokens\\/s/g) || []).length == 2", timeout=120_000)  # type: ignore[attr-defined]
    stats = pg.evaluate(f"{TEXT}('#ch-stats')")  # type: ignore[attr-defined]
    assert "Base: demo" in stats and f"Run #{job}" in stats, stats
    # The checkpoint of step 1 answers in the right panel, labelled with its step.
    _choose(pg, "#ch-checkpoint", S.WEIGHTS_STEP.format(step=1))
    _wait_text(pg, "#ch-right", "· step 1")
    _send(pg, "What is 2 + 3?")
    pg.wait_for_function(f"() => ({TEXT}('#ch-stats').match(/tokens\\/s/g) || []).length == 2 && "  # type: ignore[attr-defined]
                         f"{TEXT}('#ch-stats').includes('step 1')", timeout=120_000)
    _shot(pg, "03-chat")
    assert b"Traceback" not in (ARTIFACTS / "chat-export-app.log").read_bytes(), "the server logged a traceback"
