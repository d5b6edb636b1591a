"""Train tab handlers: the form <-> the run's YAML, presets, the memory estimate, Start.

The form's widgets arrive as positional values in `kestrel.studio.form.FORM_KEYS` order; `extra` (a
gr.State) carries the config keys the form has no widget for (column mapping, GRPO rewards),
so loading a YAML file and starting it keeps them.

    values = config_to_form(TrainConfig().to_dict())["form"]
    out = preview(extra, *[values[k] for k in FORM_KEYS])   # {"yaml", "download", "vram", "status"}
    out = start_training(extra, *[values[k] for k in FORM_KEYS])  # {"status", "job"}
"""

from __future__ import annotations

import copy
import functools
import hashlib
import math
from pathlib import Path
from typing import Any

import gradio as gr
import yaml

from kestrel.constants import merge, slug
from kestrel.config import TrainConfig, config_from_dict
from kestrel.errors import ConfigError, DatasetError, KestrelError
from kestrel.model.registry import ALL_LEVELS, family_for, is_image_text
from kestrel.training.estimate import (
    GIB, MemoryEstimate, detect_gpu, detect_host_memory, estimate_training_memory, host_verdict,
    shape_from_config, verdict,
)
from kestrel.paths import ASSETS, resolve_dataset_path
from kestrel.safe_yaml import parse_config_text, read_config_file
from kestrel.studio import files
from kestrel.studio import strings as S
from kestrel.studio.form import FIELD_BY_KEY, FORM_KEYS, REWARD_COLUMNS
from kestrel.studio.handlers.common import DEMO, check_model, is_local, model_config, user_errors

def _shipped(name: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """A config from assets/configs/ as a preset: the shipped demo YAML is the one source of these
    values (tests/training/test_demo_learns.py proves they learn). The studio picks the output folder."""
    data = yaml.safe_load((ASSETS / "configs" / name).read_text())
    return {k: v for k, v in data.items() if k not in ("output_dir", *drop)} | {"epochs": None}


PRESETS: dict[str, dict[str, Any]] = {
    "demo": _shipped("demo_sft.yaml"),
    "qlora_8b": {"method": "qlora", "max_seq_length": 2048, "batch_size": 2, "grad_accum": 4,
                 "learning_rate": 2e-4, "lora": {"r": 16, "alpha": 32}, "gradient_checkpointing": "standard",
                 "max_steps": None, "epochs": 1},
    "lora_quality": {"method": "lora", "lora": {"r": 32, "alpha": 64}, "learning_rate": 1e-4, "warmup_steps": 10},
    "long_context": {"max_seq_length": 16384, "batch_size": 1, "grad_accum": 8,
                     "gradient_checkpointing": "offload", "packing": False},
    "full_small": {"method": "full", "learning_rate": 2e-5, "batch_size": 4, "weight_decay": 0.01},
    # The model stays what the form holds: GRPO starts from the user's SFT result (for the demo, the
    # `model/` folder of a finished run of the demo preset).
    "grpo": _shipped("demo_grpo.yaml", drop=("model",)),
}


# ---------------------------------------------------------------------------------------------
# Form values <-> config dict


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in ("lora", "grpo"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    return merge(base, extra, whole=("columns",))  # a column mapping is replaced, never mixed


def _blank(cell: Any) -> bool:
    return cell is None or (isinstance(cell, float) and math.isnan(cell)) or str(cell).strip() == ""


def _table_rows(value: Any) -> list[list[Any]]:
    """A Dataframe widget's value (a DataFrame, {"data": rows} or rows) as a list of rows."""
    if hasattr(value, "values") and hasattr(value, "columns"):
        return value.values.tolist()
    if isinstance(value, dict):
        return list(value.get("data") or [])
    return list(value or [])


def rewards_from_table(value: Any) -> list[dict[str, Any]]:
    """The rewards table -> `grpo.rewards` (RewardSpec dicts). Empty rows are skipped; a weight
    or target length that is not a number is a ConfigError naming the row."""
    specs = []
    for row_number, row in enumerate(_table_rows(value), 1):
        cells = dict(zip(REWARD_COLUMNS, row))
        if _blank(cells.get("name")):
            continue
        spec: dict[str, Any] = {"name": str(cells["name"]).strip()}
        for column, kind in (("weight", float), ("target_length", int)):
            if not _blank(cells.get(column)):
                try:
                    number = float(cells[column])
                    if kind is int and not number.is_integer():
                        raise ValueError
                except (TypeError, ValueError):
                    problem = f"{column} {cells[column]!r} is not a {'whole ' if kind is int else ''}number"
                    raise ConfigError(S.ERR_REWARD_ROW.format(row=row_number, problem=problem)) from None
                spec[column] = kind(number)
        for column in ("pattern", "path"):
            if not _blank(cells.get(column)):
                spec[column] = str(cells[column])
        specs.append(spec)
    return specs


def rewards_to_table(rewards: list[dict[str, Any]] | None) -> list[list[Any]]:
    """`grpo.rewards` -> rows of the rewards table (one per reward, REWARD_COLUMNS order)."""
    return [[r.get(c) if r.get(c) is not None else "" for c in REWARD_COLUMNS] for r in rewards or []]


def _convert(key: str, value: Any) -> Any:
    """A widget's value as the config wants it; ConfigError for a number that is not one."""
    kind = FIELD_BY_KEY[key].kind
    label = S.FIELD_LABELS.get(key, key)
    if kind == "rewards":
        return rewards_from_table(value)
    if kind in ("opt_int", "opt_float", "opt_text") and (value is None or str(value).strip() == ""):
        return None
    if kind in ("int", "opt_int", "float", "opt_float"):
        if value is None or isinstance(value, bool):
            raise ConfigError(S.ERR_NUMBER.format(field=label, value=value))
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(S.ERR_NUMBER.format(field=label, value=value)) from None
        if kind.endswith("int"):
            if not number.is_integer():
                raise ConfigError(S.ERR_WHOLE.format(field=label, value=value))
            return int(number)
        return number
    if kind == "bool":
        return bool(value)
    if kind == "multi":
        return list(value or [])
    return str(value).strip() if kind == "opt_text" else value


def form_to_config(values: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config dict the form describes (not yet validated: `config_from_dict` does that)."""
    source = values.get("model_source") or DEMO
    model = DEMO if source == DEMO else str(values.get("model") or "").strip()
    data: dict[str, Any] = {"model": model, "method": values.get("method") or "lora",
                            "dataset": str(values.get("dataset") or "").strip()}
    for key, value in values.items():
        if key in FIELD_BY_KEY:
            _set(data, key, _convert(key, value))
    return _merge(extra or {}, data)


def config_to_form(config: dict[str, Any]) -> dict[str, Any]:
    """Outputs: one value per form key, and `extra` (the keys the form has no widget for)."""
    flat = _flatten(config)
    model = str(flat.get("model", DEMO))
    source = DEMO if model == DEMO else ("local" if is_local(model) else "hub")
    out: dict[str, Any] = {"model_source": source, "model": "" if source == DEMO else model}
    for key in FORM_KEYS[2:]:
        value = flat.get(key)
        if key in FIELD_BY_KEY and FIELD_BY_KEY[key].kind == "rewards":
            out[key] = rewards_to_table(value)
        else:
            out[key] = list(value) if isinstance(value, list) else value
    extra: dict[str, Any] = {}
    for key, value in flat.items():
        if key not in FORM_KEYS:
            _set(extra, key, copy.deepcopy(value))
    out["extra"] = extra
    return out


def default_form() -> dict[str, Any]:
    """The form at start: TrainConfig's defaults with the demo preset on top."""
    return config_to_form(_merge(TrainConfig().to_dict(), PRESETS["demo"]))


def _values(args: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(FORM_KEYS, args))


# ---------------------------------------------------------------------------------------------
# YAML, download file, memory estimate


def _yaml_file(cfg: TrainConfig) -> str:
    text = cfg.to_yaml()
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    stem = slug(cfg.name or "", "kestrel-run", limit=80)  # file names stop at 255 bytes
    path = files.configs_dir() / f"{stem}-{digest}.yaml"
    if not path.exists():
        path.write_text(text)
    return str(path)


@functools.lru_cache(maxsize=1)
def _gpu() -> tuple[str, int] | None:
    from kestrel import jobs

    if not any(d.startswith("cuda") for d in jobs.available_devices()):
        return None
    return detect_gpu()


@functools.lru_cache(maxsize=1)
def _host_ram() -> int | None:
    return detect_host_memory()


def _host_text(est: MemoryEstimate, method: str) -> str:
    """The offloaded layer inputs against this machine's RAM, as a markdown paragraph to append
    ("" when nothing is offloaded); what to lower when they may not fit."""
    if est.offload_host_ram == 0:
        return ""
    ram = _host_ram()
    v = host_verdict(est, ram)
    if ram is None or v is None:
        return "\n\n" + S.VRAM_HOST_NO_RAM.format(host=est.offload_host_ram / GIB)
    text = S.VRAM_HOST.format(verdict_icon=S.VRAM_ICONS[v], verdict=v, host=est.offload_host_ram / GIB,
                        ram=ram / GIB)
    if v != "fits":  # pinned pages cannot be swapped: "tight" already risks the host's OOM killer
        text += S.VRAM_HOST_LOWER["grpo" if method == "grpo" else "other"]
    return "\n\n" + text


def fast_path_text(config: dict[str, Any]) -> str:
    """How much of the model in `config` (a config.json dict) Kestrel's fast path covers, as one
    markdown line: all of it, part of it (which modules), or none (plain Hugging Face)."""
    spec = family_for(config)
    image_text = S.PATH_IMAGE_TEXT if is_image_text(config) else ""
    if spec is None:
        return S.PATH_NONE.format(model_type=config.get("model_type", "?")) + image_text
    title = S.FAMILY_TITLES.get(spec.model_type, spec.model_type)
    if ALL_LEVELS <= spec.levels and spec.decode:
        return S.PATH_FULL.format(family=title) + image_text
    levels = ", ".join(S.PATH_LEVELS[level] for level in sorted(spec.levels))
    decode = "" if spec.decode else S.PATH_HF_DECODE
    return S.PATH_PARTIAL.format(family=title, levels=levels, decode=decode) + image_text


def vram_text(data: dict[str, Any]) -> str:
    """The memory estimate for this config against the detected GPU, as one markdown line (and a
    second for the host RAM of offloaded layer inputs)."""
    config = model_config(str(data.get("model", "")))
    if config is None:
        return S.VRAM_UNKNOWN.format(reason="the model's config.json cannot be read without a download")
    path = "\n\n" + fast_path_text(config)
    try:
        shape = shape_from_config(config)
    except ValueError as exc:
        return S.VRAM_UNKNOWN.format(reason=str(exc)) + path
    lora, grpo = data.get("lora", {}), data.get("grpo", {})
    est = estimate_training_memory(
        shape, data["method"], int(lora.get("r", 16)), lora.get("targets"), int(data["batch_size"]),
        int(data["max_seq_length"]), data["gradient_checkpointing"], int(grpo.get("num_generations", 8)),
        int(grpo.get("max_completion_length", 256)), int(grpo.get("max_prompt_length", 512)))
    gpu = _gpu()
    if gpu is None:
        return S.VRAM_CPU.format(total=est.total_bytes / GIB) + _host_text(est, data["method"]) + path
    name, capacity = gpu
    v = verdict(est.total_bytes, capacity)
    return S.VRAM_LINE.format(
        verdict_icon=S.VRAM_ICONS[v], verdict=v, gpu=name, capacity=capacity / GIB, total=est.total_bytes / GIB,
        weights=est.weights / GIB, optimizer=est.optimizer / GIB, activations=est.activations / GIB,
        other=(est.extra + est.overhead) / GIB, trainable=f"{est.trainable:,}") + _host_text(est, data["method"]) + path


def _rendered(cfg: TrainConfig, data: dict[str, Any], status: str = "") -> dict[str, Any]:
    return {"yaml": cfg.to_yaml(), "download": _yaml_file(cfg), "vram": vram_text(data), "status": status}


# ---------------------------------------------------------------------------------------------
# Handlers


def preview(extra: dict[str, Any] | None, *args: Any) -> dict[str, Any]:
    """Live view of the form as YAML, its download file and the memory estimate.

    Called on every edit, so a half-typed value is a notice in `status`, not an error box.
    """
    try:
        data = form_to_config(_values(args), extra)
        cfg = config_from_dict(data)
    except KestrelError as exc:
        return {"yaml": gr.skip(), "download": gr.skip(), "vram": gr.skip(), "status": f"⚠️ {exc}"}
    return _rendered(cfg, cfg.to_dict())


def _check_types(data: dict[str, Any]) -> None:
    """Name the key of a value of the wrong type (`batch_size: many`), which the config's range
    checks would otherwise report as a bare comparison error."""
    for key, value in _flatten(data).items():
        field = FIELD_BY_KEY.get(key)
        if field is None or value is None:
            continue
        numeric = field.kind in ("int", "opt_int", "float", "opt_float")
        if numeric and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(S.ERR_YAML_NUMBER.format(key=key, value=value))
        if field.kind == "bool" and not isinstance(value, bool):
            raise ConfigError(S.ERR_YAML_BOOL.format(key=key, value=value))


def _fill(cfg: TrainConfig, status: str) -> dict[str, Any]:
    out = config_to_form(cfg.to_dict())
    out.update(_rendered(cfg, cfg.to_dict(), status))
    return out


@user_errors
def apply_yaml(text: str) -> dict[str, Any]:
    """Fill the form from YAML text. Outputs: every form key, extra, yaml, download, vram, status.

    The text is read by `kestrel.safe_yaml` (size, depth and alias-expansion limits), as files are."""
    data = parse_config_text(text or "", "the YAML box")
    _check_types(data)
    return _fill(config_from_dict(data), S.TR_YAML_APPLIED)


@user_errors
def load_yaml_file(path: str | None) -> dict[str, Any]:
    """Fill the form from an uploaded YAML file (same outputs as `apply_yaml`)."""
    if not path:
        raise ConfigError(S.ERR_NO_FILE)
    data = read_config_file(path, f"the file {Path(path).name}")
    _check_types(data)
    return _fill(config_from_dict(data), S.TR_YAML_APPLIED)


@user_errors
def apply_preset(preset: str, extra: dict[str, Any] | None, *args: Any) -> dict[str, Any]:
    """Put a preset's values over the current form (or over the defaults if it does not parse)."""
    if preset not in PRESETS:
        raise ConfigError(S.ERR_PRESET.format(preset=preset))
    try:
        base = config_from_dict(form_to_config(_values(args), extra)).to_dict()
    except KestrelError:
        base = TrainConfig().to_dict()
    cfg = config_from_dict(_merge(base, PRESETS[preset]))
    return _fill(cfg, S.TR_PRESET_APPLIED.format(name=S.PRESET_NAMES[preset]))


def use_dataset(ds_state: dict[str, Any] | None, extra: dict[str, Any] | None) -> dict[str, Any]:
    """Carry the dataset opened on the Datasets tab (with its format and column mapping) into the
    form. Outputs: dataset, dataset_format, extra."""
    if not ds_state or not ds_state.get("path"):
        return {"dataset": gr.skip(), "dataset_format": gr.skip(), "extra": gr.skip()}
    extra = copy.deepcopy(extra or {})
    extra["columns"] = dict(ds_state.get("columns") or {})
    return {"dataset": ds_state["path"], "dataset_format": ds_state.get("format") or "auto", "extra": extra}


def pick_dataset(path: str, ds_state: dict[str, Any] | None, extra: dict[str, Any] | None) -> dict[str, Any]:
    """A dataset chosen in the form's dropdown: the Datasets tab's format and column mapping
    when it is the one open there, else auto-detection (another file's mapping would not fit).
    Outputs: dataset_format, extra."""
    if ds_state and ds_state.get("path") == path:
        out = use_dataset(ds_state, extra)
        out.pop("dataset")
        return out
    extra = copy.deepcopy(extra or {})
    extra["columns"] = {}
    return {"dataset_format": "auto", "extra": extra}


def _comparable(data: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(data)
    out.pop("output_dir", None)
    for key in ("model", "dataset"):
        path = Path(str(out.get(key, ""))).expanduser()
        if path.exists():
            out[key] = str(path.resolve())
    if not Path(str(out.get("dataset", ""))).exists():
        out["dataset"] = str(resolve_dataset_path(str(out.get("dataset", ""))).resolve())
    return out


def _duplicate_of(data: dict[str, Any]) -> Any:
    """A queued or running job with the same settings (Start pressed twice), or None."""
    from kestrel import jobs

    wanted = _comparable(data)
    for job in jobs.list_jobs():
        if job.status in ("queued", "running") and _comparable(job.config) == wanted:
            return job
    return None


@user_errors
def start_training(extra: dict[str, Any] | None, *args: Any) -> dict[str, Any]:
    """Validate the form and submit it to the job store. Outputs: status, job (the new id)."""
    from kestrel import jobs

    data = config_from_dict(form_to_config(_values(args), extra)).to_dict()
    check_model(data["model"])
    if not resolve_dataset_path(data["dataset"]).is_file():
        raise DatasetError(S.ERR_DATASET_MISSING.format(path=data["dataset"]))
    if data["method"] == "qlora" and not any(d.startswith("cuda") for d in jobs.available_devices()):
        raise ConfigError(S.ERR_QLORA_CPU)
    same = _duplicate_of(data)
    if same is not None:
        raise ConfigError(S.TR_TWICE.format(job=same.id, status=same.status))
    job_id = jobs.submit(data)
    job = jobs.get_job(job_id)
    running = [j.id for j in jobs.list_jobs(status="running") if j.id != job_id]
    if job.status == "queued" and running:
        return {"status": S.TR_QUEUED.format(job=job_id, name=job.name, running=running[0]), "job": job_id}
    return {"status": S.TR_STARTED.format(job=job_id, name=job.name), "job": job_id}
