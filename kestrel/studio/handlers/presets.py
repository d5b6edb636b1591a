"""The Train form's presets: settings for a kind of run, put over the form by Apply preset.

    data, status = apply("qlora_8b", base)   # base: a checked config dict; status lists what changed

A preset sets every setting some preset names (to its own value, else the default), so nothing is
left over from the preset applied before; the user's model and dataset stay unless the preset
needs its own (`PRESET_NEEDS`). Their names shown in the studio are `strings.PRESET_NAMES`.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from kestrel.config import TrainConfig, config_from_dict
from kestrel.paths import ASSETS
from kestrel.studio import strings as S
from kestrel.studio.form import FORM_KEYS, flatten, set_dotted


def _shipped(name: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """A config from assets/configs/ as a preset: the shipped demo YAML is the one source of these
    values (tests/training/test_demo_learns.py proves they learn). The studio picks the output folder."""
    data = yaml.safe_load((ASSETS / "configs" / name).read_text())
    return {k: v for k, v in data.items() if k not in ("output_dir", *drop)} | {"epochs": None}


PRESETS: dict[str, dict[str, Any]] = {
    "demo": _shipped("demo_sft.yaml"),
    "qlora_8b": {"method": "qlora", "max_seq_length": 2048, "batch_size": 2, "grad_accum": 4,
                 "learning_rate": 2e-4, "lora": {"r": 16, "alpha": 32}, "gradient_checkpointing": "auto",
                 "max_steps": None, "epochs": 1},
    "lora_quality": {"method": "lora", "lora": {"r": 32, "alpha": 64}, "learning_rate": 1e-4, "warmup_steps": 10},
    "long_context": {"max_seq_length": 16384, "batch_size": 1, "grad_accum": 8,
                     "gradient_checkpointing": "offload", "packing": False},
    "full_small": {"method": "full", "learning_rate": 2e-5, "batch_size": 4, "weight_decay": 0.01},
    # The model stays what the form holds: GRPO starts from the user's SFT result (for the demo, the
    # `model/` folder of a finished run of the demo preset).
    "grpo": _shipped("demo_grpo.yaml", drop=("model",)),
    "dpo": _shipped("demo_dpo.yaml", drop=("model",)),  # like GRPO: from the user's SFT result
}
# The model and dataset are the user's: a preset sets them only where it cannot work with another
# (the quick test is the built-in demo model; GRPO's exact-answer reward needs a dataset with an
# `answer` column), or where the form has none yet.
# What a preset must set although the user chose it: its data kind (prompts with answers, preference pairs).
PRESET_NEEDS: dict[str, tuple[str, ...]] = {"demo": ("model",), "grpo": ("dataset",), "dpo": ("dataset",)}
# Settings of the user's own, never reset by a preset that does not name them.
PERSONAL = ("model", "dataset", "name", "output_dir", "seed", "dataset_format", "system_prompt", "columns")


def owned() -> tuple[str, ...]:
    """Every (dotted) setting some preset names, less the personal ones: each preset sets all of
    them, to its value or the default, so nothing is left over from the preset applied before."""
    keys = {key for values in PRESETS.values() for key in flatten(values)}
    return tuple(sorted(keys - set(PERSONAL)))


def _shown(value: Any) -> str:
    return "empty" if value is None or value == "" else str(value)


def preset_config(preset: str, base: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`base` (a checked config dict) with the preset applied, and what changed as "label: old → new"."""
    values, defaults = flatten(PRESETS[preset]), flatten(TrainConfig().to_dict())
    out = copy.deepcopy(base)
    for key in owned():
        set_dotted(out, key, copy.deepcopy(values.get(key, defaults.get(key))))
    for key, value in values.items():
        if key not in ("model", "dataset") and key in PERSONAL:
            set_dotted(out, key, copy.deepcopy(value))
    for key in ("model", "dataset"):
        if key in values and (key in PRESET_NEEDS.get(preset, ()) or not str(base.get(key) or "").strip()):
            out[key] = values[key]
    out = config_from_dict(out).to_dict()
    before, after = flatten(base), flatten(out)
    labels = {**S.FIELD_LABELS, "model": S.TR_MODEL, "dataset": S.TR_DATASET, "method": S.TR_METHOD}
    changes = [f"{labels.get(k, k)}: {_shown(before.get(k))} → {_shown(after[k])}"
               for k in after if k in FORM_KEYS + ("model", "dataset") and after[k] != before.get(k)]
    return out, changes


def apply(preset: str, base: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """`base` (a checked config dict) with the preset applied, and the status line that says what
    changed and which of the user's settings it kept."""
    data, changes = preset_config(preset, base)
    kept = [k for k in ("model", "dataset") if k not in PRESET_NEEDS.get(preset, ()) and base.get(k)]
    status = S.TR_PRESET_APPLIED.format(name=S.PRESET_NAMES[preset],
                                        changes="; ".join(changes) if changes else S.TR_PRESET_NO_CHANGE)
    if kept:
        status += " " + S.TR_PRESET_KEPT.format(what=" and ".join(kept))
    return data, status
