"""The one YAML reader for configs, whatever brings them: a file (`python -m kestrel train`,
`jobs submit`, the studio's upload), the studio's YAML box, or a `--key value` override.

    data = read_config_file("run.yaml")              # a dict, or ConfigError naming the file
    data = parse_config_text(text, "the YAML box")   # the same checks on text
    value = parse_value("8", "override --lora.r")    # one value (any YAML node)

It refuses, each with a one-line ConfigError that names where the text came from and what to do:
- text over MAX_BYTES (256 KiB), before parsing anything;
- bytes that are not UTF-8, or hold a NUL (a binary file);
- YAML that does not parse (the line and column of the problem);
- nesting deeper than MAX_DEPTH, refused while composing (PyYAML's composer is recursive: 5,000
  levels would otherwise end in a RecursionError);
- aliases that expand past MAX_NODES values: PyYAML shares an aliased node, so seven chained
  anchors of ten items parse in microseconds into 10**7 values that only explode later (stored as
  JSON, copied into the form). The expanded size is counted on the composed node graph, without
  expanding it; an alias that contains itself is refused too;
- a top level that is not a mapping (for a whole config).

Besides PyYAML's safe types, a number written with an exponent and no dot (`2e-4`, `1e12`) reads
as a number, as in YAML 1.2 and as on the command line (PyYAML's YAML 1.1 reads it as text).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kestrel.errors import ConfigError

MAX_BYTES = 256 * 1024  # a config is a few KiB; a long system_prompt belongs in the dataset
MAX_NODES = 10_000  # values after alias expansion (a full config has about 100)
MAX_DEPTH = 20  # nesting levels (a config needs 5: grpo -> rewards -> [i] -> name)

_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class _TooDeep(Exception):
    """Raised by the composer past MAX_DEPTH; `line` is 1-based."""

    def __init__(self, line: int) -> None:
        super().__init__(line)
        self.line = line


class _Loader(yaml.SafeLoader):
    """SafeLoader that stops composing past MAX_DEPTH levels."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def _problem(exc: yaml.YAMLError) -> str:
    """A YAML error as one line: where it is and what is wrong."""
    if isinstance(exc, yaml.reader.ReaderError) and isinstance(exc.character, int):
        return (f"character {exc.position + 1} is #x{exc.character:04x}, a control character YAML does not allow; "
                "remove it")
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or str(exc)
    text = " ".join(str(problem).split())
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {text}"
    position = getattr(exc, "position", None)
    return f"{text} (character {position})" if position is not None else text


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def check_expansion(root: yaml.Node, where: str) -> None:
    """Refuse a node graph whose aliases expand past MAX_NODES values or MAX_DEPTH levels, or
    contain themselves. Each distinct node is visited once (sizes are memoised), so a graph that
    would expand to billions of values is measured in the time its text takes to read."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded values, depth)
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            kids = [measured[id(k)] for k in _children(node)]
            size, depth = 1 + sum(k[0] for k in kids), 1 + max((k[1] for k in kids), default=0)
            if size > MAX_NODES or depth > MAX_DEPTH:
                raise ConfigError(f"{where}: its aliases (&anchor / *alias) expand to more than "
                                  f"{MAX_NODES:,} values or {MAX_DEPTH} levels; write the values out instead")
            measured[key] = (size, depth)
        elif key in on_path:
            raise ConfigError(f"{where}: an alias on line {node.start_mark.line + 1} contains itself; "
                              "a config cannot be recursive")
        elif key not in measured:
            on_path.add(key)
            stack.append((node, True))
            stack.extend((kid, False) for kid in _children(node))


def _compose(text: str, where: str) -> Any:
    """Parse `text` after the depth and expansion checks; None for an empty document."""
    try:
        loader = _Loader(text)  # text (not bytes) is checked for control characters here
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML: {_problem(exc)}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_expansion(node, where)
        return loader.construct_document(node)
    except _TooDeep as deep:
        raise ConfigError(f"{where} nests more than {MAX_DEPTH} levels deep (line {deep.line}); "
                          "a training config needs at most 5") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML: {_problem(exc)}") from None
    except (ValueError, OverflowError) as exc:  # a constructor's: a 5,000-digit int, a 13th month
        reason = " ".join(str(exc).split(";")[0].split())
        raise ConfigError(f"{where} is not valid YAML: a value cannot be read ({reason})") from None
    except RecursionError:  # a safety net: the depth limit stops nesting well before this
        raise ConfigError(f"{where} nests too deeply to read") from None
    finally:
        loader.dispose()


def _text(data: str | bytes, where: str) -> str:
    """`data` as text within the size limit: UTF-8 (a BOM is dropped), no NUL bytes."""
    size = len(data.encode("utf-8", errors="surrogatepass") if isinstance(data, str) else data)
    if size > MAX_BYTES:
        raise ConfigError(f"{where} is {size:,} bytes; configs are limited to {MAX_BYTES // 1024} KiB "
                          "(a long system prompt belongs in the dataset)")
    if isinstance(data, bytes):
        if b"\x00" in data:  # tell a binary file from text in another encoding
            raise ConfigError(f"{where} holds binary data (a NUL byte at offset {data.index(0)}), not YAML text")
        try:
            data = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                              "save it as UTF-8") from None
    if "\x00" in data:
        raise ConfigError(f"{where} holds binary data (a NUL character at offset {data.index(chr(0))}), "
                          "not YAML text")
    return data


def parse_value(text: str | bytes, where: str) -> Any:
    """Any YAML value (a command-line override), with every check but the mapping one."""
    return _compose(_text(text, where), where)


def parse_config_text(text: str | bytes, where: str) -> dict[str, Any]:
    """A whole config's YAML as a mapping ({} when empty); ConfigError naming `where` otherwise."""
    data = parse_value(text, where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a single text"}.get(type(data), f"a single {type(data).__name__}")
        raise ConfigError(f"{where} must be a mapping of keys to values (key: value lines), got {kind}")
    return data


def read_limited(path: Path, where: str) -> bytes:
    """At most MAX_BYTES + 1 bytes of a regular file (a device or FIFO is refused, not read)."""
    try:
        if not path.is_file():
            raise ConfigError(f"{where} does not exist (or is not a file)")
        with open(path, "rb") as f:
            return f.read(MAX_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{where} cannot be read: {reason}") from None


def read_config_file(path: str | Path, where: str | None = None) -> dict[str, Any]:
    """A YAML config file as a mapping; every problem a ConfigError naming the file (`where`,
    default "config file PATH")."""
    p = Path(path)
    where = where or f"config file {p}"
    data = read_limited(p, where)
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{where} is over {MAX_BYTES // 1024} KiB; configs are limited to "
                          f"{MAX_BYTES // 1024} KiB (a long system prompt belongs in the dataset)")
    return parse_config_text(data, where)
