"""Where the studio keeps files, and how an upload gets there safely.

Everything lives under KESTREL_HOME: uploaded datasets in `datasets/`, exports in `exports/`,
config files offered for download in `studio/configs/`, Gradio's own upload cache in
`studio/tmp/` (app.py points GRADIO_TEMP_DIR there). An uploaded file is copied under a
sanitised name, so a crafted name (`../../.bashrc`, `C:\\x`, control characters) can never write
outside `datasets/`, and an existing dataset is never overwritten by a different file.

Paths a studio user types are confined the same way (`studio_dataset`, `studio_output_dir`,
`studio_folder` for a local model or adapter): a logged-in remote user must not read the host's
files (nor train on a private model and download the export) or write runs anywhere but `runs/`. The
check runs before the file is opened, so an error never shows content from outside. (The command
line has no such limit: a path given there is its user's own choice.)
"""

from __future__ import annotations

import hashlib
import re
import shutil
import unicodedata
from pathlib import Path

from kestrel.errors import ConfigError, DatasetError
from kestrel.paths import SAMPLE_DATASETS, is_inside, kestrel_home, models_dir, runs_dir, sample_dataset
from kestrel.studio import strings as S

DATASET_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
# The upload size limit when the studio is started without --max-upload-mb: uploads are read into
# memory row by row, and a 1 GiB dataset is far past what one GPU trains on in a session.
DEFAULT_MAX_UPLOAD_MB = 1024.0


def _subdir(*parts: str) -> Path:
    path = kestrel_home().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def datasets_dir() -> Path:
    return _subdir("datasets")


def exports_dir() -> Path:
    return _subdir("exports")


def configs_dir() -> Path:
    return _subdir("studio", "configs")


def gradio_tmp_dir() -> Path:
    return _subdir("studio", "tmp")


def served_dirs() -> list[str]:
    """Folders whose files the browser may download (exports and config files; never the
    database or the runs)."""
    return [str(exports_dir()), str(configs_dir())]


def safe_filename(name: str, default_stem: str = "dataset") -> str:
    """A file name safe to create in one folder: no separators, no leading dot, ASCII only.

    Both `/` and `\\` count as separators (a Windows browser may send `C:\\Users\\x.jsonl`), so
    only the last component is kept; `..` and hidden names lose their leading dots.
    """
    base = re.split(r"[\\/]", name or "")[-1]
    base = unicodedata.normalize("NFKD", base).encode("ascii", "ignore").decode()
    stem, dot, ext = base.rpartition(".")
    if not dot:
        stem, ext = base, ""
    stem = _UNSAFE.sub("_", stem).strip("._-")[:80] or default_stem
    ext = _UNSAFE.sub("", ext).lower()[:10]
    return f"{stem}.{ext}" if ext else stem


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def sniff(path: Path, name: str) -> None:
    """Raise DatasetError when the file's bytes contradict its extension (a renamed image, a
    zip called .csv, a gzip-compressed .jsonl, NUL bytes, a cut-short Parquet file): the dataset
    reader's own content check, so an upload is refused by the same rules as a training run."""
    from kestrel.data.reader import check_file  # here: kestrel.data imports torch, and launch imports this module early

    check_file(path, name)


def store_upload(src: str | Path, original_name: str | None, max_bytes: int) -> Path:
    """Copy an uploaded file into `datasets/` under a safe, unused name; returns the new path.

    Checks, in order: extension, empty, size limit, content matches the extension. The same
    content uploaded again reuses the file it already has.
    """
    src = Path(src)
    name = safe_filename(original_name or src.name)
    ext = Path(name).suffix.lower()
    if ext not in DATASET_EXTENSIONS:
        raise DatasetError(S.ERR_EXTENSION.format(name=name, allowed=", ".join(DATASET_EXTENSIONS)))
    size = src.stat().st_size
    if size == 0:
        raise DatasetError(S.ERR_EMPTY.format(name=name))
    if size > max_bytes:
        raise DatasetError(S.ERR_TOO_BIG.format(name=name, size=size / 2**20, limit=max_bytes / 2**20))
    sniff(src, name)
    folder = datasets_dir()
    digest = file_digest(src)
    stem, suffix = Path(name).stem, Path(name).suffix
    for i in range(1000):
        target = folder / (f"{stem}{suffix}" if i == 0 else f"{stem}-{i}{suffix}")
        if target.resolve().parent != folder.resolve():  # belt and braces: never outside
            raise DatasetError(S.ERR_BAD_NAME.format(name=original_name))
        if not target.exists():
            tmp = folder / f".upload-{digest[:16]}{suffix}"
            shutil.copyfile(src, tmp)
            tmp.replace(target)
            return target
        if file_digest(target) == digest:
            return target
    raise DatasetError(S.ERR_BAD_NAME.format(name=original_name))


def discard_upload(path: str | Path) -> None:
    """Delete Gradio's cached copy of an upload (only inside `studio/tmp/`, never a file elsewhere)."""
    try:
        resolved = Path(path).resolve()
        if is_inside(resolved, gradio_tmp_dir().resolve()) and resolved.is_file():
            resolved.unlink()
    except OSError:
        pass  # the day-old cache cleaner removes it later


def _resolve_from(text: str, field: str, base: Path) -> Path:
    """`text` as an absolute path with symlinks followed, a relative one taken from `base`."""
    try:
        path = Path(text).expanduser()
        return (path if path.is_absolute() else base / path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise ConfigError(S.ERR_PATH_UNUSABLE.format(field=field, path=text, error=exc)) from None


def studio_dataset(text: str, field: str = "dataset") -> Path:
    """A dataset named in the studio (`field`: dataset or eval_dataset): a shipped sample's name, or
    a file inside KESTREL_HOME (a relative path is taken from `datasets/`). DatasetError naming the
    field for anything else, before the file is touched."""
    sample = sample_dataset(text)
    if sample is not None:
        return sample
    path = _resolve_from(text, field, datasets_dir())
    if not (is_inside(path, kestrel_home().resolve()) or is_inside(path, SAMPLE_DATASETS.resolve())):
        raise DatasetError(S.ERR_DATASET_OUTSIDE.format(field=field, path=text, home=kestrel_home()))
    return path


def studio_output_dir(text: str) -> Path:
    """An output folder named in the studio: a folder below KESTREL_HOME/runs (a relative path is
    taken from there: `my-run` is `runs/my-run`). ConfigError naming the field for anything else."""
    runs = runs_dir().resolve()
    path = _resolve_from(text, "output_dir", runs)
    if path == runs or not is_inside(path, runs):
        raise ConfigError(S.ERR_OUTPUT_OUTSIDE.format(path=text, runs=runs))
    return path


def studio_folder(text: str, field: str, base: Path | None = None) -> Path:
    """A local model or adapter folder named in the studio: inside KESTREL_HOME (a relative path
    is taken from `base`, default `models/`). ConfigError naming the field otherwise."""
    path = _resolve_from(text, field, base or models_dir())
    if not is_inside(path, kestrel_home().resolve()):
        raise ConfigError(S.ERR_FOLDER_OUTSIDE.format(field=field, path=text, home=kestrel_home()))
    return path
