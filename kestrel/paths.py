"""Where Kestrel writes at run time: everything lives under KESTREL_HOME (default ~/.kestrel)."""

from __future__ import annotations

import re
from pathlib import Path

from kestrel import env

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SAMPLE_DATASETS = ASSETS / "datasets"


def kestrel_home() -> Path:
    """The folder that holds models, datasets, runs and the job database; created on demand."""
    home = Path(env.raw("KESTREL_HOME") or Path.home() / ".kestrel").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home


HOME_VARS = ("${KESTREL_HOME}", "$KESTREL_HOME")  # how a config names KESTREL_HOME in a path


def expand_home(text: str) -> str:
    """A path that starts with `$KESTREL_HOME` (or `${KESTREL_HOME}`) with that part replaced by
    `kestrel_home()`, so a shared config file writes where the studio looks, whatever KESTREL_HOME
    is (~/.kestrel when unset); any other text unchanged."""
    for var in HOME_VARS:
        if text == var or text.startswith((var + "/", var + "\\")):
            return str(kestrel_home()) + text[len(var):]
    return text


def runs_dir() -> Path:
    path = kestrel_home() / "runs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    path = kestrel_home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sample_dataset(name: str) -> Path | None:
    """The shipped sample called `name` (`arithmetic_chat` or `arithmetic_chat.jsonl`), or None."""
    for sample in SAMPLE_DATASETS.glob("*"):
        if name in (sample.name, sample.stem):
            return sample
    return None


def resolve_dataset_path(name: str) -> Path:
    """A dataset path as the user wrote it, or the name of a shipped sample (`arithmetic_chat`)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    return sample_dataset(name) or path


def is_inside(path: Path, root: Path) -> bool:
    """Whether resolved `path` is `root` or lies below it (both already resolved)."""
    return path == root or root in path.parents


def model_stem(model: str) -> str:
    """A short name for a model, to name runs after: a hub id's or a folder's last part; for the
    weights a run saved (RUN/model, RUN/checkpoints/step-N/model), the run's own name (its folder
    without the job store's `job-N-` prefix), since "model" says nothing."""
    path = Path(str(model))
    if path.name != "model" or not path.parent.name:
        return path.name
    run = path.parents[2] if path.parent.parent.name == "checkpoints" else path.parent
    return re.sub(r"^job-\d+-", "", run.name) or path.name
