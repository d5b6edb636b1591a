"""How a mapping becomes a checked config dataclass: every value checked for its field's kind
(list items and mapping values too), numbers finite and within SQLite's 64-bit integers, text free
of NUL and not too long, unknown keys named with the valid ones listed. Shared by every section of
the training config (`kestrel.config`, `kestrel.config_preference`) and the export job's settings;
torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import fields
from typing import Any, get_type_hints

from kestrel.errors import ConfigError

# Bounds: far past any sane run, well inside what the job store (SQLite int64) and torch take.
INT64_MAX = 2**63 - 1
MAX_TEXT = 65_536  # characters of any text value (a system prompt)
MAX_PATH = 1024  # characters of a path (output_dir, dataset, model)
MAX_ITEMS = 100  # items of a list or mapping value (lora.targets, columns, grpo.rewards)

# Text fields that YAML users write unquoted as booleans (`off` and `on` are YAML 1.1 booleans).
BOOLEAN_WORDS: dict[str, dict[bool, str]] = {
    "gradient_checkpointing": {False: "off", True: "standard"},
    "performance.cuda_graphs": {False: "off", True: "on"},
}


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def show(value: Any) -> str:
    """A value for an error message: its repr, cut short (and safe for a 5,000-digit number)."""
    try:
        text = repr(value)
    except ValueError:  # int too large to print
        return "a number too large to print"
    return text if len(text) <= 80 else text[:77] + "..."


def _key_text(key: str) -> str:
    """A key as written when it is plain text, else its repr (cut short)."""
    return key if key.isprintable() and len(key) <= 80 else show(key)


def at_most(name: str, value: float | None, limit: float, unit: str = "") -> None:
    if value is not None and value > limit:
        raise ConfigError(f"{name} must be at most {limit:,}{unit}, got {show(value)}")


def check_path_text(name: str, text: str | None) -> None:
    """A path as text: no control characters, at most MAX_PATH characters, no part over 255 bytes
    (what file systems take). Whether it exists is checked when the run is submitted."""
    if text is None:
        return
    check(not any(ord(c) < 32 for c in text), f"{name} must not contain control characters (a newline, a tab)")
    check(len(text) <= MAX_PATH, f"{name} is {len(text):,} characters long; at most {MAX_PATH:,}")
    long_part = next((part for part in re.split(r"[/\\]", text) if len(part.encode("utf-8", "replace")) > 255), None)
    check(long_part is None, f"{name} has a part over 255 bytes ({show(long_part)}); file systems refuse it")


def build_checked(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a mapping, naming any unknown key and listing the valid ones.

    Every value is checked for its field's kind first (`checked_value`), so a wrong type is an
    error naming the key rather than a bare comparison error from the range checks."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping of keys to values, got {type(data).__name__}")
    odd = next((k for k in data if not isinstance(k, str)), None)
    if odd is not None:
        raise ConfigError(f"{where or 'config'}: keys must be text, got {show(odd)}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown config key {prefix}{_key_text(unknown[0])}; valid keys{' under ' + where if where else ''}: "
            + ", ".join(sorted(names))
        )
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        nested, dotted = hints[key], f"{where}.{key}".strip(".")
        if dataclasses.is_dataclass(nested) and isinstance(nested, type):
            value = value if isinstance(value, nested) else build_checked(nested, value, dotted)
        else:
            if isinstance(value, bool) and dotted in BOOLEAN_WORDS:  # `gradient_checkpointing: off`
                value = BOOLEAN_WORDS[dotted][value]
            value = checked_value(dotted, nested, value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from exc


_SCALARS = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}


def _as_scalar(kind: type, value: Any) -> tuple[bool, Any]:
    """Whether `value` is of scalar `kind`, and the value as that kind: a whole float is an int
    (`max_steps: 1e3`), an int is a float; a bool is neither."""
    if isinstance(value, bool) or kind is bool:
        return kind is bool and isinstance(value, bool), value
    if kind is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return True, int(value)
        return isinstance(value, int), value
    if kind is float and isinstance(value, (int, float)):
        try:
            return True, float(value)
        except OverflowError:  # an int past float's range
            return True, math.inf
    return isinstance(value, kind), value


def _within_limits(key: str, value: Any) -> Any:
    """Numbers finite and within SQLite's int64, text free of NUL and at most MAX_TEXT long."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if isinstance(value, int) and not isinstance(value, bool) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ConfigError(f"{key} is out of range: {show(value)} does not fit in 64 bits")
    if isinstance(value, str):
        check("\x00" not in value, f"{key} must not contain NUL characters")
        check(len(value) <= MAX_TEXT, f"{key} is {len(value):,} characters long; at most {MAX_TEXT:,}")
    return value


def checked_value(key: str, hint: Any, value: Any) -> Any:
    """`value` checked against field type `hint` and returned in that type, or a ConfigError that
    names `key`: scalars (see `_as_scalar`), optional ones, lists (each item) and mappings (each
    key and value). Kinds it does not know (a nested dataclass in a list) are left to the field."""
    origin = typing.get_origin(hint)
    if origin is list:
        return _checked_list(key, typing.get_args(hint)[0], value)
    if origin is dict:
        return _checked_mapping(key, typing.get_args(hint)[1], value)
    args = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    options = [a for a in args if a is not type(None)]
    if value is None and len(options) < len(args):
        return None
    if not options or any(t not in _SCALARS for t in options):
        return value
    for kind in options:
        ok, converted = _as_scalar(kind, value)
        if ok:
            return _within_limits(key, converted)
    raise ConfigError(f"{key} must be {' or '.join(_SCALARS[t] for t in options)}, got {show(value)}")


def _checked_list(key: str, item: Any, value: Any) -> list[Any]:
    """A list value: a single text for a list of text is split at commas (`q_proj` or
    `q_proj, v_proj`), never into characters; each item checked and named by its index."""
    if isinstance(value, str) and item is str:
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list):
        raise ConfigError(f"{key} must be a list, got {show(value)}")
    check(len(value) <= MAX_ITEMS, f"{key} has {len(value):,} items; at most {MAX_ITEMS}")
    if dataclasses.is_dataclass(item):
        return list(value)  # built and checked by the section that holds it (grpo.rewards)
    return [checked_value(f"{key}[{i}]", item, v) for i, v in enumerate(value)]


def _checked_mapping(key: str, item: Any, value: Any) -> dict[str, Any]:
    """A mapping value (`columns`): text keys, each value checked and named by its key."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping (role: column name), got {show(value)}")
    check(len(value) <= MAX_ITEMS, f"{key} has {len(value):,} entries; at most {MAX_ITEMS}")
    odd = next((k for k in value if not isinstance(k, str)), None)
    if odd is not None:
        raise ConfigError(f"{key}: keys must be text, got {show(odd)}")
    return {k: checked_value(f"{key}.{k}", item, v) for k, v in value.items()}
