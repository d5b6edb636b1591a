"""Helpers of the studio tests: polling with a deadline, the Train form as positional values."""

from __future__ import annotations

from typing import Any

import gradio as gr

from kestrel.studio.form import FORM_KEYS
from kestrel.studio.handlers import train
from tests.jobs.jobkit import wait_for  # noqa: F401  (the studio tests poll the same way)


def form(**changes: Any) -> tuple[dict[str, Any], list[Any]]:
    """(extra, positional form values): the default form with `changes` (dotted keys as __)."""
    values = train.default_form()
    extra = values.pop("extra")
    for key, value in changes.items():
        values[key.replace("__", ".")] = value
    return extra, [values[k] for k in FORM_KEYS]


def error_text(excinfo: Any) -> str:
    """The message a gr.Error shows the user."""
    exc = excinfo.value
    assert isinstance(exc, gr.Error)
    return str(exc.message)
