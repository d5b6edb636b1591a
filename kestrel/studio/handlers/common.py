"""Helpers every tab's handlers share: turning errors into messages, resolving a model the user
named, and process-wide caches of read-only resources (tokenizers, model configs).

The caches hold things every browser session may share because nobody mutates them; no user's
data lives at module level.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import gradio as gr

from kestrel.constants import DEMO
from kestrel.errors import KestrelError
from kestrel.studio import strings as S

log = logging.getLogger("kestrel.studio")
F = TypeVar("F", bound=Callable[..., Any])


def _message(exc: BaseException) -> gr.Error:
    if isinstance(exc, gr.Error):
        return exc
    if isinstance(exc, (KestrelError, ValueError)):  # ValueError: sampling settings, adapters
        return gr.Error(str(exc), print_exception=False)
    log.exception("unexpected error in a studio handler")
    return gr.Error(S.ERR_UNEXPECTED.format(kind=type(exc).__name__), print_exception=False)


def user_errors(fn: F) -> F:
    """Raise every failure of `fn` as a `gr.Error` whose text the user can act on.

    Gradio shows a gr.Error as a message box, never a traceback. Errors meant for the user
    (KestrelError and its kinds, ValueError) keep their own text; anything else is logged with
    its traceback on the server and shown as a short notice. Works on generator handlers too.
    """
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen_wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                yield from fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - converted, never swallowed
                raise _message(exc) from exc
        return gen_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - converted, never swallowed
            raise _message(exc) from exc
    return wrapper  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Models the user names: `demo`, a local folder, or a hub id


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def is_local(model: str) -> bool:
    path = Path(model).expanduser()
    return path.is_absolute() or model.startswith((".", "~")) or path.exists()


def _cached_hub_file(repo_id: str, filename: str) -> str | None:
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(repo_id, filename)
    except HFValidationError as exc:
        raise KestrelError(S.ERR_HUB_ID.format(model=repo_id, error=exc)) from exc
    return found if isinstance(found, str) else None


def check_model(model: str, look_up: bool = False) -> None:
    """Raise a KestrelError that says what to do when `model` cannot be used as named. With
    `look_up`, a hub id not in the local cache is looked up on the hub (a few seconds at most)."""
    model = (model or "").strip()
    if not model:
        raise KestrelError(S.ERR_MODEL_EMPTY)
    if model == DEMO:
        return
    if is_local(model):
        path = Path(model).expanduser()
        if not path.is_dir():
            raise KestrelError(S.ERR_MODEL_FOLDER.format(path=path))
        if not (path / "config.json").is_file():
            raise KestrelError(S.ERR_MODEL_NO_CONFIG.format(path=path))
        return
    if _cached_hub_file(model, "config.json") is None:
        if offline():
            raise KestrelError(S.ERR_HUB_OFFLINE.format(model=model))
        if look_up:
            from kestrel.jobs.preflight import look_up_on_hub

            look_up_on_hub(model)


def model_config(model: str) -> dict[str, Any] | None:
    """The model's config.json as a dict, when it can be read without a download (None when it
    cannot, or is not a JSON object)."""
    from kestrel.paths import ASSETS

    model = (model or "").strip()
    if model == DEMO:
        path: str | Path | None = ASSETS / "demo" / "config.json"
    elif is_local(model):
        path = Path(model).expanduser() / "config.json"
    else:
        path = _cached_hub_file(model, "config.json") if model else None
    if path is None or not Path(path).is_file():
        return None
    try:
        data = _read_json(str(path), Path(path).stat().st_mtime)
    except (OSError, ValueError):  # unreadable, not UTF-8 or not JSON: no estimate, not an error box
        return None
    return data if isinstance(data, dict) else None


@functools.lru_cache(maxsize=16)
def _read_json(path: str, _mtime: float) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def tokenizer_for(model: str) -> Any:
    """The tokenizer training would use for `model` (ChatML when it ships no template); a local
    folder must lie inside KESTREL_HOME, as for training."""
    from kestrel.studio.files import studio_folder

    if model.strip() != DEMO and is_local(model.strip()):
        model = str(studio_folder(model.strip(), "model"))
    check_model(model)
    return _tokenizer(model.strip())


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str) -> Any:
    from kestrel.errors import ModelLoadError
    from kestrel.model.loader import DEMO_ASSETS, load_tokenizer, resolve_model_path

    # The demo's tokenizer ships in assets/: no need to build its weights for a preview.
    path = str(DEMO_ASSETS) if model == DEMO else resolve_model_path(model)
    try:
        return load_tokenizer(path, 1 << 20)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(S.ERR_TOKENIZER.format(model=model, error=exc)) from exc


def fmt_duration(seconds: float | None) -> str:
    """`1:02:03`, `4:05`, or `-` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "-"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"
