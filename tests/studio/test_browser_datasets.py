"""The Datasets tab in a real Chromium, against `python app.py` (issue 29, "Data"): each dataset
opened shows its own length histogram, skipped lines are listed with their numbers, a failed
detection clears the token preview, a column mapping chosen in the page is kept (Open and the
Train tab's dataset dropdown apply it), characters split over several tokens show whole, and both
tabs warn when max_seq_length cuts many rows.

Screenshots land in test-artifacts/studio-datasets/. Needs Debian's chromium (/usr/bin/chromium);
skipped with the reason when absent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel.data.formats import load_conversations
from kestrel.studio.handlers import datasets as ds
from kestrel.studio.handlers.common import tokenizer_for
from tests.studio.browser_kit import (
    NEEDS_CHROMIUM, REPO, TEXT, chromium_page, choose as _choose, studio, wait_text as _wait_text,
)

ARTIFACTS = REPO / "test-artifacts" / "studio-datasets"
SHARED_HOME = True
UNITS = "It is 25°C, 3×4 = 12, −1 🙂 日本語"  # characters byte-level BPE splits over 2-4 tokens

pytestmark = [pytest.mark.browser, pytest.mark.slow, NEEDS_CHROMIUM]


@pytest.fixture(scope="module")
def page(module_home: Path) -> Iterator[object]:
    """A Chromium page on `python app.py` (own port, own KESTREL_HOME), at the studio's start."""
    with studio(module_home, ARTIFACTS / "app.log") as url, chromium_page() as pg:
        pg.goto(url)
        pg.wait_for_selector("#ds-upload input[type=file]", state="attached")
        yield pg
    assert b"Traceback" not in (ARTIFACTS / "app.log").read_bytes(), "the server logged a traceback"


def _write(folder: Path, name: str, rows: list[dict[str, str]], broken_line: int | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    if broken_line is not None:
        lines[broken_line - 1] = lines[broken_line - 1][:20]  # cut short
    path = folder / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _upload(pg: object, path: Path) -> None:
    """Upload `path` as a user would. The box empties once the file is stored, so the next upload
    needs no clearing first (the file input is back within 10 s)."""
    pg.locator("#ds-upload input[type=file]").set_input_files(str(path), timeout=10_000)  # type: ignore[attr-defined]
    _wait_text(pg, "#ds-status", path.name)
    pg.locator("#ds-upload input[type=file]").wait_for(state="attached", timeout=10_000)  # type: ignore[attr-defined]


def _first_bucket(path: Path) -> str:
    """The label of the first bar of this file's own histogram (demo tokenizer)."""
    _, convs, _ = load_conversations(str(path))
    return str(ds.histogram_frame(ds.token_lengths(convs, tokenizer_for("demo")))["tokens"].iloc[0])


def _text(pg: object, selector: str) -> str:
    return pg.evaluate(f"{TEXT}({json.dumps(selector)})")  # type: ignore[attr-defined]


def test_each_dataset_shows_its_own_histogram_and_a_failed_one_clears_the_tokens(page: object,
                                                                                  tmp_path: Path) -> None:
    pg = page
    sizes = {"short": 2, "mid": 40, "long": 150}
    files = {name: _write(tmp_path, f"{name}.jsonl", [{"prompt": "Say it", "completion": " ".join(["word"] * (n + i % 7))}
                                                      for i in range(30)], broken_line=3 if name == "mid" else None)
             for name, n in sizes.items()}
    shown = []
    for name, path in files.items():
        _upload(pg, path)
        own = _first_bucket(path)
        shown.append(own)
        # Before the fix each histogram showed the previous file's buckets until a reload.
        pg.wait_for_function(f"l => {TEXT}('#ds-hist').includes(l)", arg=own, timeout=20_000)  # type: ignore[attr-defined]
        assert len(shown) == 1 or shown[-2] not in _text(pg, "#ds-hist")
        _wait_text(pg, "#ds-token-summary", "trained")
        if name == "mid":  # the cut-short line is skipped into the report, with its number and why
            _wait_text(pg, "#ds-report", "cut short")
            assert re.search(r"\b3\s+is not valid JSON", _text(pg, "#ds-report")), _text(pg, "#ds-report")
            pg.screenshot(path=str(ARTIFACTS / "01-mid-report.png"), full_page=True)  # type: ignore[attr-defined]
    assert "word" in _text(pg, "#ds-tokens")
    pg.screenshot(path=str(ARTIFACTS / "02-long.png"), full_page=True)  # type: ignore[attr-defined]
    # A file no format matches: a notice, and no rows of the last good dataset left in the token preview.
    unknown = tmp_path / "unknown.csv"
    unknown.write_text("q,a\nWhat is 2 + 2?,4\n")
    _upload(pg, unknown)
    _wait_text(pg, "#ds-status", "no known format")
    pg.wait_for_function(f"() => !{TEXT}('#ds-tokens').includes('word') && {TEXT}('#ds-token-summary') === ''",  # type: ignore[attr-defined]
                         timeout=10_000)
    pg.screenshot(path=str(ARTIFACTS / "03-unknown.png"), full_page=True)  # type: ignore[attr-defined]


def test_a_mapping_is_kept_characters_show_whole_and_truncation_warns(page: object, tmp_path: Path) -> None:
    pg = page
    units = tmp_path / "units.csv"
    long_answer = " ".join(["word"] * 80)  # far past the demo preset's max_seq_length of 64
    rows = [f'"Weather {i}?","{UNITS}"' for i in range(8)] + [f'"Essay {i}?","{long_answer}"' for i in range(2)]
    units.write_text("q,a\n" + "\n".join(rows) + "\n")
    _upload(pg, units)
    _wait_text(pg, "#ds-status", "no known format")
    _choose(pg, "#ds-format", "prompt_completion")  # the role dropdowns appear for the picked format
    _choose(pg, "#ds-col-prompt", "q")
    _choose(pg, "#ds-col-completion", "a")
    pg.get_by_role("button", name="Apply format and columns", exact=True).click()  # type: ignore[attr-defined]
    _wait_text(pg, "#ds-status", "10 usable rows as prompt_completion")
    _wait_text(pg, "#ds-tokens", "日本語")
    tokens = _text(pg, "#ds-tokens")
    assert all(ch in tokens for ch in ("°", "×", "−", "🙂")) and "\ufffd" not in tokens
    _wait_text(pg, "#ds-truncation", "20% of rows (2 of 10) are longer than max_seq_length=64")
    pg.screenshot(path=str(ARTIFACTS / "04-mapped.png"), full_page=True)  # type: ignore[attr-defined]
    for length, warned in (("128", False), ("64", True)):  # the Datasets tab follows the Train form's length
        pg.get_by_role("tab", name="Train").click()  # type: ignore[attr-defined]
        pg.locator("#tr-max-seq-length input").fill(length)  # type: ignore[attr-defined]
        pg.get_by_role("tab", name="Datasets").click()  # type: ignore[attr-defined]
        pg.wait_for_function(f"w => {TEXT}('#ds-truncation').includes('are longer than') === w",  # type: ignore[attr-defined]
                             arg=warned)
    # Another dataset, then units.csv again through Open: read with the saved mapping, no detection.
    pg.get_by_role("button", name="Use sample", exact=True).click()  # type: ignore[attr-defined]
    _wait_text(pg, "#ds-status", "arithmetic_chat")
    _choose(pg, "#ds-registered", "units.csv")
    pg.get_by_role("button", name="Open", exact=True).click()  # type: ignore[attr-defined]
    _wait_text(pg, "#ds-status", "Loaded units.csv: 10 usable rows as prompt_completion")
    # The Train tab's own dropdown, with another dataset open on the Datasets tab: the saved mapping again.
    pg.get_by_role("button", name="Use sample", exact=True).click()  # type: ignore[attr-defined]
    _wait_text(pg, "#ds-status", "arithmetic_chat")
    pg.get_by_role("tab", name="Train").click()  # type: ignore[attr-defined]
    _choose(pg, "#tr-dataset", "units.csv")
    pg.get_by_text("Advanced", exact=True).click()  # type: ignore[attr-defined]  # dataset_format lives there
    pg.wait_for_function(  # type: ignore[attr-defined]
        "() => (document.querySelector('#tr-dataset-format input') || {}).value === 'prompt_completion'")
    _wait_text(pg, "#tr-vram", "are longer than max_seq_length=64")
    pg.locator("#tr-max-seq-length input").fill("128")  # type: ignore[attr-defined]  # long enough: no warning
    pg.wait_for_function(f"() => !{TEXT}('#tr-vram').includes('are longer than')")  # type: ignore[attr-defined]
    pg.screenshot(path=str(ARTIFACTS / "05-train.png"), full_page=True)  # type: ignore[attr-defined]
