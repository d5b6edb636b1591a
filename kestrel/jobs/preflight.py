"""Checks a training config must pass before it is queued, so what would only fail minutes
later in the worker (a missing dataset or model, an output folder that is a file) is refused at
submit, with nothing stored. No network: a hub id is checked for its form, and found in the local
Hugging Face cache or accepted with a note.

    notes = check_training(cfg)   # ConfigError / DatasetError / ModelLoadError, else notes to show

Light on purpose (no torch): the command line and the studio call it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kestrel.config import TrainConfig, check_output_dir, expand_path
from kestrel.constants import DEMO
from kestrel.errors import ConfigError, DatasetError, ModelLoadError
from kestrel.model.safe_weights import refuse_pickled
from kestrel.paths import resolve_dataset_path

# A Hugging Face repo id: `name` or `owner/name`, letters, digits, `-`, `_`, `.`, at most 96.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


def exists(path: Path) -> bool:
    """`path.exists()`, False for a path the OS refuses (too long, a NUL)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def looks_local(model: str) -> bool:
    """Whether `model` names a folder rather than a hub id (the model loader's own rule)."""
    if model.startswith((".", "~", "/")):
        return True
    return exists(Path(model))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _in_hub_cache(model: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    except Exception:  # noqa: BLE001 - no hub library or an odd cache: treat as not cached
        return False


def check_model(model: str) -> str | None:
    """`demo`, a folder holding config.json, or a well-formed hub id; returns a note for a hub
    id that is not in the local cache (the job downloads it), refuses it when offline."""
    if model == DEMO:
        return None
    if looks_local(model):
        path = expand_path(model, "model")
        if not exists(path / "config.json"):
            what = "has no config.json" if path.is_dir() else "does not exist"
            raise ModelLoadError(f"model folder {path} {what}: point `model` at a Hugging Face model folder "
                                 "(the one holding config.json and *.safetensors), or use demo")
        refuse_pickled(path)
        return None
    if not _HUB_ID.match(model) or ".." in model or "--" in model or model.endswith((".", "-")):
        raise ModelLoadError(f"model {model!r} is neither a local folder nor a Hugging Face hub id "
                             "(owner/name, e.g. Qwen/Qwen3-0.6B), nor demo")
    if _in_hub_cache(model):
        return None
    if _offline():
        raise ModelLoadError(f"model {model!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                             "set; download it first or point `model` at a local folder")
    return f"model {model} is not in the local Hugging Face cache; the job downloads it when it starts"


HUB_LOOKUP_S = 5.0  # the most a submit waits for the hub to say whether a model id exists


def look_up_on_hub(model: str, timeout: float = HUB_LOOKUP_S) -> None:
    """Ask the Hugging Face hub whether the hub id `model` (not in the local cache) exists and can
    be downloaded, waiting at most `timeout` seconds; a ModelLoadError says what to do when not:
    misspelt, gated, or the hub out of reach (an offline machine)."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().model_info(model, timeout=timeout)
    except GatedRepoError:
        raise ModelLoadError(f"model {model!r} is gated on the Hugging Face hub: accept its licence on its page, "
                             "log in (`hf auth login`), then start again") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"model {model!r} is neither in the local Hugging Face cache nor on the hub "
                             "(or it is private): check the id (owner/name, e.g. Qwen/Qwen3-0.6B)") from None
    except (HfHubHTTPError, httpx.HTTPError, OSError) as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"model {model!r} is not in the local Hugging Face cache, and the hub could not be "
                             f"reached to look it up ({reason}): this machine seems offline. Connect it to the "
                             "network, or pick a local model folder or the demo model") from None


def check_dataset(dataset: str, field: str = "dataset") -> None:
    """The dataset (or the file named by `field`) is a file, or the name of a shipped sample."""
    try:
        found = resolve_dataset_path(dataset).is_file()
    except (OSError, ValueError, RuntimeError):
        found = False
    if not found:
        raise DatasetError(f"{field} {dataset} does not exist (or is not a file); give the path of a .jsonl, "
                           ".json, .csv or .parquet file, or a sample name such as arithmetic_chat")


def check_training(cfg: TrainConfig) -> list[str]:
    """Every submit-time check of a training config; returns notes worth showing the user."""
    check_dataset(cfg.dataset)
    if cfg.eval_dataset:
        check_dataset(cfg.eval_dataset, "eval_dataset")
    note = check_model(cfg.model)
    if cfg.output_dir:
        check_output_dir(cfg.output_dir)
    if cfg.lora.init_from and not exists(expand_path(cfg.lora.init_from, "lora.init_from")):
        raise ConfigError(f"lora.init_from {cfg.lora.init_from} does not exist; point it at a trained adapter "
                          "or a finished run's folder")
    for spec in cfg.grpo.rewards if cfg.method == "grpo" else []:
        if spec.name == "custom":
            path = expand_path(str(spec.path), "grpo.rewards path")
            if path.suffix != ".py" or not path.is_file():
                raise ConfigError(f"grpo.rewards: custom reward file {path} does not exist or is not a .py file")
    return [note] if note else []


def check_devices(spec: int | str | list[int], device: str | None, available: list[str]) -> None:
    """A run's `devices` must fit the devices jobs may use (`available`: the job runner's list)
    and leave the choice of GPUs to the queue."""
    gpus = [d for d in available if d != "cpu"]
    if spec in (1, "auto"):
        return
    if device is not None and device != "cpu":
        raise ConfigError(f"devices: {spec} and a device ({device}) were both given; a run on several devices "
                          "takes its GPUs from the queue: leave the device out")
    if isinstance(spec, list):
        missing = [i for i in spec if f"cuda:{i}" not in gpus]
        if missing:
            raise ConfigError(f"devices lists GPU {missing[0]}, which jobs may not use here; "
                              f"available: {', '.join(gpus) or 'no GPU (write devices: N for N CPU processes)'}")
    elif gpus and spec > len(gpus):
        raise ConfigError(f"devices: {spec} asks for more GPUs than the {len(gpus)} jobs may use here "
                          f"({', '.join(gpus)})")
