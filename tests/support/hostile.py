"""Hostile inputs the tests share (issue 30): YAML alias bombs, damaged configs and damaged
dataset files, each generated from a seeded `random.Random` so a failure can be replayed."""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path
from typing import Any

import yaml


def alias_bomb(padding_to: int = 713) -> str:
    """Seven chained anchors of ten items under lora.targets (issue 30): 10**7 module names once
    expanded, in `padding_to` bytes."""
    lines = ["model: demo", "lora:", "  targets:", "    - &a [" + ", ".join(["q_proj"] * 10) + "]"]
    for prev, name in zip("abcdef", "bcdefg"):
        lines.append(f"    - &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    text = "\n".join(lines) + "\n"
    return text + "#" * (padding_to - len(text) - 1) + "\n"


# --- configs -------------------------------------------------------------------------------------

CONFIG_KEYS = ["model", "method", "dataset", "output_dir", "name", "max_seq_length", "max_steps", "epochs",
               "learning_rate", "batch_size", "grad_accum", "packing", "gradient_checkpointing", "save_steps", "seed",
               "dtype", "warmup_steps", "lr_scheduler", "weight_decay", "max_grad_norm", "logging_steps",
               "dataset_format", "columns", "system_prompt", "fast_kernels", "lora", "grpo", "performance", "lora.r",
               "lora.alpha", "lora.targets", "lora.dropout", "lora.init_from", "grpo.num_generations", "grpo.top_p",
               "grpo.beta", "grpo.temperature", "grpo.num_iterations", "grpo.rewards", "grpo.loss_type",
               "performance.cuda_graphs", "performance.offload_gate", "columns.prompt"]


def config_values(rng: random.Random, tmp: Path) -> list[Any]:
    """Hostile values for any key: wrong types, huge and non-finite numbers, paths that escape."""
    return ["many", "", "off", "on", None, True, False, 0, -1, 1, 3.5, -0.0, 2**31, 2**63, 2**80, -(2**70), 10**30,
            1e12, 1e308, math.nan, math.inf, -math.inf, [1, 2], ["q_proj", 5], [], {}, {"a": {"b": 1}},
            [{"name": "exactly"}], [{"name": "format_regex", "pattern": "(x"}], [{"name": "exact_answer",
                                                                                    "weight": math.nan}],
            "a\x00b", "x" * rng.choice([241, 300, 5000]), "../../etc", str(tmp / "afile"), "/dev/null",
            "line\nbreak", "~nobody-xyz/run", "someone/model", "demo", "arithmetic_prompts", "xml", "grpo",
            "\u202e\u0000", "😀" * 40, {"prompt": 5}]


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        node = data.get(part)
        if not isinstance(node, dict):
            node = data[part] = {}
        data = node
    data[last] = value


def config_text_mutant(rng: random.Random, text: str) -> str | bytes:
    """YAML text damaged: cut, bracket floods, alias bombs, random bytes, duplicate keys, odd documents."""
    kind = rng.randrange(9)
    if kind == 0:
        return text[: rng.randrange(len(text))]  # cut anywhere
    if kind == 1:
        return text + "lora: " + "[" * rng.choice([19, 21, 60, 5000]) + "\n"
    if kind == 2:
        return alias_bomb() if rng.random() < 0.5 else text + "lora: &x {targets: *x}\n"
    if kind == 3:
        return rng.randbytes(rng.randrange(1, 2048))
    if kind == 4:
        cut = rng.randrange(len(text))
        return text.encode()[:cut] + rng.randbytes(rng.randrange(1, 16)) + text.encode()[cut:]
    if kind == 5:
        line = rng.choice([line for line in text.splitlines() if ":" in line])
        return text + line + "\n"  # a duplicated key
    if kind == 6:
        return rng.choice(["- a\n- b\n", "42\n", "'text'\n", "~\n", "!!binary aGVsbG8=\n", "? [a]\n: b\n", "a: !!set {x}\n"])
    if kind == 7:
        return text + "seed: " + "9" * rng.choice([19, 400, 5000]) + "\n"
    return text + rng.choice(["grpo:\n  rewards:\n    - name: format_regex\n      pattern: '['\n",
                              "max_steps: 1e12\n", "epochs: .inf\n", "weight_decay: .nan\n", "lora: {alpha: 1e30}\n",
                              "gradient_checkpointing: off\n", "name: " + "r" * 250 + "\n", "<<: *nope\n"])


def config_mutant(rng: random.Random, base: dict[str, Any], tmp: Path) -> str | bytes:
    """A damaged config: text damage (35%) or 1-3 keys set to hostile values or removed."""
    if rng.random() < 0.35:
        return config_text_mutant(rng, yaml.safe_dump(base, sort_keys=False))
    data = yaml.safe_load(yaml.safe_dump(base))
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.25 and data:
            data.pop(rng.choice(sorted(data)))
        else:
            _set(data, rng.choice(CONFIG_KEYS), rng.choice(config_values(rng, tmp)))
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=rng.random() < 0.5)


# --- dataset files -------------------------------------------------------------------------------

SAMPLE_ROWS = [{"prompt": f"What is {i} + {i}?", "completion": str(2 * i), "meta": {"tags": ["math", "easy"], "n": i}}
          for i in range(6)]


def dataset_base(ext: str) -> bytes:
    """Six good rows as a .jsonl, .json or .csv file."""
    if ext == ".jsonl":
        return "".join(json.dumps(r) + "\n" for r in SAMPLE_ROWS).encode()
    if ext == ".json":
        return json.dumps(SAMPLE_ROWS, indent=1).encode()
    return ("prompt,completion,meta\n" + "".join(f'"{r["prompt"]}",{r["completion"]},"{r["meta"]}"\n'
                                                 for r in SAMPLE_ROWS)).encode()


def dataset_mutant(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    """One random damage: truncation, byte flips, a bracket flood, a huge number, a wrong type,
    joined or repeated lines, bytes that are not UTF-8, a lone surrogate escape, gzip."""
    kinds = ["truncate", "flip", "flood", "number", "type", "join", "repeat", "utf8", "surrogate", "gzip"]
    kind = rng.choices(kinds, weights=[3, 3, 3, 1, 1, 1, 1, 1, 1, 0.3])[0]
    at = rng.randrange(len(data) + 1)
    if kind == "truncate":
        return kind, data[:at]
    if kind == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] = rng.choice([0, 0xFF, 0xC3, *b'"{}[]\n\\,:', rng.randrange(256)])
        return kind, bytes(out)
    if kind == "flood":
        unit = rng.choice([b"[", b"{", b'{"a":', b"[{", b"]", b'"[', b"\\"])
        return kind, data[:at] + unit * rng.choice([70, 5000, 30000]) + data[at:]
    if kind == "number":
        number = rng.choice([b"1" * 5000, b"1e999999", b"-" + b"9" * 400, b"1" * 200 + b".5e-99999", b"NaN"])
        return kind, data.replace(b'"5"' if b'"5"' in data else b"5", number, 1)
    if kind == "type":
        value = rng.choice([b"null", b"[]", b"{}", b"42", b"true", b'[{"role": 1}]', b'{"x": null}'])
        return kind, data.replace(b'"What is 1 + 1?"', value).replace(b"What is 1 + 1?", value)
    if kind == "join":
        return kind, data.replace(b"\n", b" ", rng.randint(1, 3))
    if kind == "repeat":
        line = rng.choice(data.splitlines() or [b""])
        return kind, data + (line + b"\n") * rng.choice([2, 500])
    if kind == "utf8":
        return kind, data[:at] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf0\x28\x8c"]) + data[at:]
    if kind == "surrogate":
        return kind, data.replace(b"easy", b"\\ud800", 1)
    return kind, gzip.compress(data)
