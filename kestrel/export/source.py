"""What to export: a training output folder, a PEFT adapter folder, a model folder, or `demo`.

    src = resolve_source("runs/my-run")   # -> adapter on top of its base model, or a full fine-tune
    src.family.gguf_arch, src.tokenizer_dir, src.adapter_dir

A training output folder holds `adapter/` (LoRA / QLoRA: a PEFT folder whose adapter_config.json
names the base model), or `model/` (a full fine-tune), and `config.yaml`. When the run evaluated,
its best weights (`best/`, marked by `best/best.json`) are exported instead, and the notes say so;
point at `RUN/adapter` (or `RUN/model`) for the final weights.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kestrel.errors import ConfigError, KestrelError
from kestrel.model.multimodal import is_image_text
from kestrel.model.registry import FamilySpec, SUPPORTED, family_for, text_config
from kestrel.model.safe_weights import refuse_pickled
from kestrel.safe_yaml import read_config_file
from kestrel.training.best import BEST_DIR, read_best

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class ExportSource:
    """A resolved source. `model_dir` holds the (base) weights; `adapter_dir` the LoRA, if any."""

    name: str
    model_dir: Path
    config: Any  # transformers PretrainedConfig of model_dir
    family: FamilySpec  # of its language model
    adapter_dir: Path | None = None
    method: str | None = None  # from the run's config.yaml: qlora, lora, full, grpo
    notes: list[str] = field(default_factory=list)

    @property
    def image_text(self) -> bool:
        """An image-text checkpoint: GGUF export writes its language model."""
        return is_image_text(self.config)

    @property
    def lm_config(self) -> Any:
        """The language model's config (an image-text model's text config, whose output head
        is tied as the whole model's is)."""
        if not self.image_text:
            return self.config
        config = copy.deepcopy(text_config(self.config))
        config.tie_word_embeddings = bool(getattr(self.config, "tie_word_embeddings", False))
        return config

    @property
    def tokenizer_dir(self) -> Path:
        """The adapter's folder when training saved the tokenizer there (it may add a template)."""
        if self.adapter_dir is not None and any((self.adapter_dir / f).is_file() for f in _TOKENIZER_FILES):
            return self.adapter_dir
        return self.model_dir


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def _check_weights(folder: Path) -> None:
    if _has_weights(folder):
        return
    refuse_pickled(folder)
    raise KestrelError(
        f"{folder} has no weights (*.safetensors): point SOURCE at a training output folder "
        "(holding adapter/ or model/), a PEFT adapter folder, or a model folder"
    )


def _base_model_dir(adapter_dir: Path) -> Path:
    from kestrel.model.loader import resolve_model_path

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise KestrelError(f"{adapter_dir}/adapter_config.json does not name its base model (base_model_name_or_path)")
    path = Path(resolve_model_path(base))
    if not path.is_dir():
        path = _cached_hub_model(base)
    return path


def _cached_hub_model(repo_id: str) -> Path:
    """A hub model already in the local Hugging Face cache (export never downloads)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - any failure means "not cached"; the message says what to do
        raise KestrelError(
            f"the adapter's base model {repo_id!r} is not a local folder and not in the Hugging Face cache; "
            "download it first or edit base_model_name_or_path in adapter_config.json"
        ) from exc


def _run_method(folder: Path) -> str | None:
    config = folder / "config.yaml"
    if not config.is_file():
        return None
    try:  # the size, depth and alias limits of every config read; an unreadable one names no method
        data = read_config_file(config)
    except ConfigError:
        return None
    method = data.get("method")
    return method if isinstance(method, str) else None


def _locate(path: Path) -> tuple[Path | None, Path | None, str | None]:
    """(model folder, adapter folder, method) for a source folder (a checkpoint's method is its run's)."""
    method = _run_method(path) or (_run_method(path.parent.parent) if path.parent.name == "checkpoints" else None)
    if (path / "model" / "config.json").is_file():  # a full fine-tune's output
        return path / "model", None, method
    if (path / "adapter" / "adapter_config.json").is_file():
        return None, path / "adapter", method
    if (path / "adapter_config.json").is_file():
        return None, path, method or _run_method(path.parent)
    if (path / "config.json").is_file():
        return path, None, method
    return None, None, method


def load_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise KestrelError(f"could not read {model_dir}/config.json: {exc}") from exc


def resolve_source(source: str | Path) -> ExportSource:
    """Find the weights, adapter and family of `source`; raise KestrelError on anything unusable."""
    from kestrel.model.loader import DEMO, resolve_model_path

    path = Path(resolve_model_path(DEMO)) if str(source) == DEMO else Path(source).expanduser()
    if not path.is_dir():
        raise KestrelError(f"export source {path} is not a folder")
    model_dir, adapter_dir, method = _locate(path)
    notes = []
    best = read_best(path) if model_dir != path and adapter_dir != path else None  # a run folder
    if best is not None and (model_dir or adapter_dir):
        final = model_dir or adapter_dir
        model_dir, adapter_dir, _ = _locate(path / BEST_DIR)
        notes.append(f"exporting the run's best weights: {best['metric']} {best['value']:.4f} at step {best['step']} "
                     f"({path / BEST_DIR}); export {final} for the final weights instead")
    if model_dir is None and adapter_dir is None:
        raise KestrelError(
            f"{path} is neither a training output folder (adapter/ or model/), a PEFT adapter folder "
            "(adapter_config.json) nor a model folder (config.json + *.safetensors)"
        )
    if adapter_dir is not None:
        if not (adapter_dir / "adapter_model.safetensors").is_file():
            raise KestrelError(f"{adapter_dir} has no adapter_model.safetensors: the adapter has no weights")
        model_dir = _base_model_dir(adapter_dir)
    assert model_dir is not None
    _check_weights(model_dir)
    config = load_config(model_dir)
    family = family_for(config)
    if family is None:
        raise KestrelError(
            f"export does not support the {config.model_type!r} architecture (from {model_dir}/config.json); "
            f"supported: {', '.join(SUPPORTED)}"
        )
    name = path.name if path.name not in ("adapter", "model") else path.parent.name
    return ExportSource(name=name or "model", model_dir=model_dir, config=config, family=family,
                        adapter_dir=adapter_dir, method=method, notes=notes)
