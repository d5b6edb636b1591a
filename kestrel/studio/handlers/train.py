"""Train tab handlers: the form <-> the run's YAML, presets (values in `presets.py`), the memory estimate, Start.

The form's widgets arrive as positional values in `kestrel.studio.form.FORM_KEYS` order; `extra` (a
gr.State) carries the config keys the form has no widget for (column mapping, GRPO rewards),
so loading a YAML file and starting it keeps them.

    values = config_to_form(TrainConfig().to_dict())["form"]
    out = preview(extra, *[values[k] for k in FORM_KEYS])   # {"yaml", "download", "vram", "status"}
    out = start_training(extra, *[values[k] for k in FORM_KEYS], allow_custom=False)  # {"status", "job"}

Every config the tab builds goes through `studio_config`: the studio's rules on top of the config's
own checks. `allow_custom` is the studio's launch setting (`--allow-custom-rewards`), passed down by
`kestrel.studio.events`; nothing a browser sends can turn it on. Datasets and output folders must lie
inside KESTREL_HOME (`kestrel.studio.files`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import math
from pathlib import Path
from typing import Any

import gradio as gr

from kestrel.constants import merge, slug
from kestrel.config import PerformanceSettings, TrainConfig, config_from_dict
from kestrel.errors import ConfigError, DatasetError, KestrelError
from kestrel.model.registry import ALL_LEVELS, family_for, is_image_text
from kestrel.recompute.policy import choose_checkpointing
from kestrel.training.estimate import (
    GIB, MemoryEstimate, ModelShape, common_gpu, detect_gpu, detect_host_memory, estimate_training_memory,
    host_verdict, shape_from_config, training_rows, verdict,
)
from kestrel.paths import resolve_dataset_path, runs_dir
from kestrel.safe_yaml import parse_config_text, read_config_file
from kestrel.studio import files
from kestrel.studio import strings as S
from kestrel.studio.form import FIELD_BY_KEY, FORM_KEYS, OWNER_KEYS, REWARD_COLUMNS, flatten, set_dotted
from kestrel.studio.handlers import presets
from kestrel.studio.handlers.common import DEMO, check_model, is_local, model_config, user_errors
from kestrel.studio.handlers.datasets import truncation_note

YAML_EXTENSIONS = (".yaml", ".yml")


# ---------------------------------------------------------------------------------------------
# Form values <-> config dict


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
    if kind == "devices":
        return devices_from_text(value)
    return str(value).strip() if kind == "opt_text" else value


def devices_from_text(value: Any) -> Any:
    """The Devices box as the config's `devices`: "auto", a count ("2"), GPU ids ("0, 1"); empty is
    1. Anything else is passed on for the config to name."""
    text = str(value if value is not None else "").strip()
    if not text:
        return 1
    parts = [p.strip() for p in text.split(",")]
    if all(p.isdigit() for p in parts):
        return int(parts[0]) if len(parts) == 1 else [int(p) for p in parts]
    return text


def devices_to_text(value: Any) -> str:
    return ", ".join(str(v) for v in value) if isinstance(value, list) else str(value)


def form_to_config(values: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config dict the form describes (not yet validated: `config_from_dict` does that)."""
    source = values.get("model_source") or DEMO
    model = DEMO if source == DEMO else str(values.get("model") or "").strip()
    data: dict[str, Any] = {"model": model, "method": values.get("method") or "lora",
                            "dataset": str(values.get("dataset") or "").strip()}
    for key, value in values.items():
        if key in FIELD_BY_KEY:
            set_dotted(data, key, _convert(key, value))
    return _merge(extra or {}, data)


def config_to_form(config: dict[str, Any]) -> dict[str, Any]:
    """Outputs: one value per form key, and `extra` (the keys the form has no widget for)."""
    flat = flatten(config)
    model = str(flat.get("model", DEMO))
    source = DEMO if model == DEMO else ("local" if is_local(model) else "hub")
    out: dict[str, Any] = {"model_source": source, "model": "" if source == DEMO else model}
    for key in FORM_KEYS[2:]:
        value = flat.get(key)
        if key in FIELD_BY_KEY and FIELD_BY_KEY[key].kind == "rewards":
            out[key] = rewards_to_table(value)
        elif key in FIELD_BY_KEY and FIELD_BY_KEY[key].kind == "devices":
            out[key] = devices_to_text(value if value is not None else 1)
        else:
            out[key] = list(value) if isinstance(value, list) else value
    extra: dict[str, Any] = {}
    for key, value in flat.items():
        if key not in FORM_KEYS and key not in OWNER_KEYS:
            set_dotted(extra, key, copy.deepcopy(value))
    out["extra"] = extra
    return out


def studio_config(data: dict[str, Any], allow_custom: bool) -> TrainConfig:
    """`data` checked as a config and by the studio's rules: `grpo.allow_custom_rewards` is the
    studio's launch setting whatever `data` says (a custom reward without it is refused, naming
    the flag); the dataset, the output folder and local model and adapter folders must lie inside KESTREL_HOME."""
    data = copy.deepcopy(data)
    grpo = data.setdefault("grpo", {})
    if isinstance(grpo, dict):  # anything else: config_from_dict names the mistake
        rewards = grpo.get("rewards")
        for spec in rewards if isinstance(rewards, list) else []:
            if isinstance(spec, dict) and spec.get("name") == "custom" and not allow_custom:
                raise ConfigError(S.ERR_CUSTOM_OFF.format(path=spec.get("path")))
        grpo["allow_custom_rewards"] = allow_custom
    cfg = config_from_dict(data)
    files.studio_dataset(cfg.dataset)
    if cfg.eval_dataset:
        files.studio_dataset(cfg.eval_dataset, "eval_dataset")
    if cfg.output_dir:
        files.studio_output_dir(cfg.output_dir)
    if cfg.model != DEMO and is_local(cfg.model):
        files.studio_folder(cfg.model, "model")
    if cfg.lora.init_from:
        files.studio_folder(cfg.lora.init_from, "lora.init_from", runs_dir())
    return cfg


def default_form() -> dict[str, Any]:
    """The form at start: TrainConfig's defaults with the demo preset on top."""
    return config_to_form(presets.preset_config("demo", TrainConfig().to_dict())[0])


def _values(args: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(FORM_KEYS, args))


# ---------------------------------------------------------------------------------------------
# YAML, download file, memory estimate


def _yaml_file(cfg: TrainConfig, text: str) -> str:
    """The download file of `cfg`, whose YAML is `text`: named by the run and a digest of it."""
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
    """The offloaded activations against this machine's RAM, as a markdown paragraph to append
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
    if ALL_LEVELS <= spec.levels:
        return (S.PATH_FULL if spec.decode else S.PATH_TRAINS_FAST).format(family=title) + image_text
    levels = ", ".join(S.PATH_LEVELS[level] for level in sorted(spec.levels))
    decode = "" if spec.decode else S.PATH_HF_DECODE
    return S.PATH_PARTIAL.format(family=title, levels=levels, decode=decode) + image_text


def _estimate(shape: ModelShape, data: dict[str, Any], devices: int, checkpointing: str) -> MemoryEstimate:
    """`estimate_training_memory` of the form's settings (and the YAML's `performance.offload_gate` and
    `keep_attention`, as a run reads them), with `checkpointing` resolved."""
    lora, grpo = data.get("lora", {}), data.get("grpo", {})
    method, rows = training_rows(data["method"], data.get("preference", {}).get("finetune", "lora"),
                                 int(data["batch_size"]))
    return estimate_training_memory(
        shape, method, int(lora.get("r", 16)), lora.get("targets"), rows, int(data["max_seq_length"]), checkpointing,
        int(grpo.get("num_generations", 8)), int(grpo.get("max_completion_length", 256)),
        int(grpo.get("max_prompt_length", 512)), devices,
        float(data.get("performance", {}).get("offload_gate", PerformanceSettings.offload_gate)),
        str(data.get("performance", {}).get("keep_attention", PerformanceSettings.keep_attention)),
        str(data.get("performance", {}).get("keep_projection", PerformanceSettings.keep_projection)),
        str(data.get("performance", {}).get("keep_qkv", PerformanceSettings.keep_qkv)))


def _checkpointing(shape: ModelShape, data: dict[str, Any], devices: int, on_cuda: bool) -> tuple[str, str]:
    """The form's gradient checkpointing and "", or for `auto` the mode a run here gets
    (`kestrel.recompute.policy`) and a paragraph saying which and why."""
    mode = data["gradient_checkpointing"]
    if mode != "auto":
        return mode, ""
    need = _estimate(shape, data, 1, "offload").offload_host_ram
    mode, why = choose_checkpointing(on_cuda, devices, need, _host_ram())
    return mode, "\n\n" + S.VRAM_AUTO.format(mode=mode, why=why)


def vram_text(data: dict[str, Any], picked_gpu: str | None = None) -> str:
    """The memory estimate for this config against the detected GPU, or on a machine without one
    against `picked_gpu` (a name of `COMMON_GPUS_MIB`), as one markdown line (then the host RAM
    of offloaded activations, and what `auto` checkpointing chose), then how much of the model the
    fast path covers."""
    config = model_config(str(data.get("model", "")))
    if config is None:
        return S.VRAM_UNKNOWN.format(reason="the model's config.json cannot be read (not downloaded yet, or not valid JSON)")
    path = "\n\n" + fast_path_text(config)
    try:
        shape = shape_from_config(config)
    except ValueError as exc:
        return S.VRAM_UNKNOWN.format(reason=str(exc)) + path
    from kestrel import jobs
    from kestrel.jobs.store import gpus_wanted

    devices = gpus_wanted(data, jobs.available_devices())  # auto: every GPU jobs may use (one CPU process)
    gpu = _gpu()
    picked = common_gpu(picked_gpu) if gpu is None else None
    mode, auto = _checkpointing(shape, data, devices, gpu is not None or picked is not None)
    est = _estimate(shape, data, devices, mode)
    path = auto + path
    if gpu is None and picked is None:  # on the CPU every rank is a process of this size
        return S.VRAM_CPU.format(total=devices * est.total_bytes / GIB) + _host_text(est, data["method"]) + path
    name, capacity = gpu or picked  # type: ignore[misc]
    v = verdict(est.total_bytes, capacity)
    prefix = S.VRAM_PICKED if picked else ""
    return prefix + S.VRAM_LINE.format(
        verdict_icon=S.VRAM_ICONS[v], verdict=v, gpu=name, capacity=capacity / GIB, total=est.total_bytes / GIB,
        per_gpu=S.VRAM_PER_GPU.format(n=devices) if devices > 1 else "",
        weights=est.weights / GIB, optimizer=est.optimizer / GIB, activations=est.activations / GIB,
        other=(est.extra + est.overhead + est.communication) / GIB, trainable=f"{est.trainable:,}"
    ) + _host_text(est, data["method"]) + path


def _rendered(cfg: TrainConfig, data: dict[str, Any], status: str = "", gpu: str | None = None) -> dict[str, Any]:
    cut = "" if data["method"] == "grpo" else truncation_note(  # GRPO's limits are its prompt and completion lengths
        data["dataset"], data["dataset_format"], data["columns"], data["model"], data["max_seq_length"])
    text = cfg.to_yaml()
    return {"yaml": text, "download": _yaml_file(cfg, text), "vram": vram_text(data, gpu) + (cut and "\n\n" + cut),
            "status": status}


# ---------------------------------------------------------------------------------------------
# Handlers


def preview(extra: dict[str, Any] | None, *args: Any, gpu: str | None = None, allow_custom: bool = False) -> dict[str, Any]:
    """Live view of the form as YAML, its download file and the memory estimate (for `gpu`, a
    card picked by name, on a machine without one).

    Called on every edit, so a half-typed value is a notice in `status`, not an error box.
    """
    try:
        data = form_to_config(_values(args), extra)
        cfg = studio_config(data, allow_custom)
    except KestrelError as exc:
        return {"yaml": gr.skip(), "download": gr.skip(), "vram": gr.skip(), "status": f"⚠️ {exc}"}
    return _rendered(cfg, cfg.to_dict(), gpu=gpu)


def gpu_picker() -> dict[str, Any]:
    """The picker of a GPU to estimate for: shown only on a machine without one. Output: gpu."""
    return {"gpu": gr.update(visible=_gpu() is None)}


def _fill(cfg: TrainConfig, status: str) -> dict[str, Any]:
    out = config_to_form(cfg.to_dict())
    out.update(_rendered(cfg, cfg.to_dict(), status))
    return out


@user_errors
def apply_yaml(text: str, allow_custom: bool = False) -> dict[str, Any]:
    """Fill the form from YAML text. Outputs: every form key, extra, yaml, download, vram, status.

    The text is read by `kestrel.safe_yaml` (size, depth and alias-expansion limits), as files are."""
    data = parse_config_text(text or "", "the YAML box")
    return _fill(studio_config(data, allow_custom), S.TR_YAML_APPLIED)


@user_errors
def load_yaml_file(path: str | None, allow_custom: bool = False) -> dict[str, Any]:
    """Fill the form from an uploaded YAML file (same outputs as `apply_yaml`)."""
    if not path:
        raise ConfigError(S.ERR_NO_FILE)
    if Path(path).suffix.lower() not in YAML_EXTENSIONS:  # the upload button's file_types, checked here too
        raise ConfigError(S.ERR_EXTENSION.format(name=Path(path).name, allowed=", ".join(YAML_EXTENSIONS)))
    data = read_config_file(path, f"the file {Path(path).name}")
    return _fill(studio_config(data, allow_custom), S.TR_YAML_APPLIED)


@user_errors
def apply_preset(preset: str, extra: dict[str, Any] | None, *args: Any, allow_custom: bool = False) -> dict[str, Any]:
    """Put a preset over the current form (or over the defaults if it does not parse): it sets
    every setting it owns and keeps the user's model and dataset unless it needs its own. The
    status lists what changed (`kestrel.studio.handlers.presets`)."""
    if preset not in presets.PRESETS:
        raise ConfigError(S.ERR_PRESET.format(preset=preset))
    try:
        base = studio_config(form_to_config(_values(args), extra), allow_custom).to_dict()
    except KestrelError:
        base = TrainConfig().to_dict()
    data, status = presets.apply(preset, base)
    return _fill(studio_config(data, allow_custom), status)


def use_dataset(ds_state: dict[str, Any] | None, extra: dict[str, Any] | None) -> dict[str, Any]:
    """Carry the dataset opened on the Datasets tab (with its format and column mapping) into the
    form; one whose format was not found stays out of it. Outputs: dataset, dataset_format, extra."""
    if not ds_state or not ds_state.get("path") or not ds_state.get("usable", True):
        return {"dataset": gr.skip(), "dataset_format": gr.skip(), "extra": gr.skip()}
    extra = copy.deepcopy(extra or {})
    extra["columns"] = dict(ds_state.get("columns") or {})
    return {"dataset": ds_state["path"], "dataset_format": ds_state.get("format") or "auto", "extra": extra}


def pick_dataset(path: str, ds_state: dict[str, Any] | None, extra: dict[str, Any] | None) -> dict[str, Any]:
    """A dataset chosen in the form's dropdown: the Datasets tab's format and column mapping
    when it is the one open there, else the mapping saved with it in the job store, else
    auto-detection (another file's mapping would not fit). Outputs: dataset_format, extra."""
    from kestrel import jobs

    if ds_state and ds_state.get("path") == path:
        out = use_dataset(ds_state, extra)
        out.pop("dataset")
        return out
    fmt, columns = jobs.saved_mapping(path) or ("auto", {})  # the mapping saved with the dataset
    extra = copy.deepcopy(extra or {})
    extra["columns"] = columns
    return {"dataset_format": fmt, "extra": extra}


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
def start_training(extra: dict[str, Any] | None, *args: Any, allow_custom: bool = False) -> dict[str, Any]:
    """Validate the form and submit it to the job store. Outputs: status, job (the new id).

    The datasets and output folder are submitted as the absolute paths that were checked, so the
    worker (which runs in another folder) reads and writes exactly there."""
    from kestrel import jobs

    cfg = studio_config(form_to_config(_values(args), extra), allow_custom)  # the one validation of the form
    if cfg.model != DEMO and is_local(cfg.model):
        cfg.model = str(files.studio_folder(cfg.model, "model"))
    if cfg.lora.init_from:
        cfg.lora.init_from = str(files.studio_folder(cfg.lora.init_from, "lora.init_from", runs_dir()))
    check_model(cfg.model, look_up=True)  # an unknown hub id is refused now, not 25 s into the job
    dataset = files.studio_dataset(cfg.dataset)
    if not dataset.is_file():
        raise DatasetError(S.ERR_DATASET_MISSING.format(path=cfg.dataset))
    cfg.dataset = str(dataset)
    if cfg.eval_dataset:
        held = files.studio_dataset(cfg.eval_dataset, "eval_dataset")
        if not held.is_file():
            raise DatasetError(S.ERR_EVAL_MISSING.format(path=cfg.eval_dataset))
        cfg.eval_dataset = str(held)
    if cfg.output_dir:
        cfg.output_dir = str(files.studio_output_dir(cfg.output_dir))
    if cfg.load_in_4bit and not any(d.startswith("cuda") for d in jobs.available_devices()):
        raise ConfigError(S.ERR_QLORA_CPU)
    same = _duplicate_of(cfg.to_dict())
    if same is not None:
        raise ConfigError(S.TR_TWICE.format(job=same.id, status=same.status))
    job_id = jobs.submit(cfg)  # the checked TrainConfig itself: not parsed and validated a second time
    job = jobs.get_job(job_id)
    running = [j.id for j in jobs.list_jobs(status="running") if j.id != job_id]
    if job.status == "queued" and running:
        return {"status": S.TR_QUEUED.format(job=job_id, name=job.name, running=running[0]), "job": job_id}
    return {"status": S.TR_STARTED.format(job=job_id, name=job.name), "job": job_id}
