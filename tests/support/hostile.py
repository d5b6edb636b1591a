"""Hostile YAML the config tests share."""

from __future__ import annotations


def alias_bomb(padding_to: int = 713) -> str:
    """Seven chained anchors of ten items under lora.targets (issue 30): 10**7 module names once
    expanded, in `padding_to` bytes."""
    lines = ["model: demo", "lora:", "  targets:", "    - &a [" + ", ".join(["q_proj"] * 10) + "]"]
    for prev, name in zip("abcdef", "bcdefg"):
        lines.append(f"    - &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    text = "\n".join(lines) + "\n"
    return text + "#" * (padding_to - len(text) - 1) + "\n"
