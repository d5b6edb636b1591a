"""Helpers of the studio tests: polling with a deadline, the Train form as positional values."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import gradio as gr

from studio.form import FORM_KEYS
from studio.handlers import train


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


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
