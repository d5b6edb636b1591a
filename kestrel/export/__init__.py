"""Export a trained model: the adapter alone, a merged 16-bit model, or a GGUF file for llama.cpp
and Ollama, each checked before it is called done.

    result = export("runs/my-run", "gguf", "exports/my-run", quant="q4_k_m", progress=print_progress)
    result.files, result.checks, result.notes

Every file is first written to a staging folder inside `out_dir` and moved into place only after
its checks pass; on any error, or a failed check, the staging folder is removed, so no partial
file is left behind. Disk space is checked before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Callable

from kestrel.errors import KestrelError
from kestrel.export.quantize import QUANT_TYPES, check_quant

FORMATS = ("adapter", "merged", "gguf")
MERGED_DTYPES = ("auto", "bf16", "f16", "f32")
Progress = Callable[[float, str], None]

__all__ = ["FORMATS", "MERGED_DTYPES", "QUANT_TYPES", "ExportCheckError", "ExportResult", "describe_check", "export"]


@dataclass
class ExportResult:
    """What an export wrote and what its checks found."""

    format: str
    out_dir: Path
    quant: str | None
    files: list[Path] = field(default_factory=list)
    passed: bool = False
    checks: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        def plain(value: Any) -> Any:
            if is_dataclass(value):
                return plain(asdict(value))
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            return str(value) if isinstance(value, Path) else value

        return plain({k: getattr(self, k) for k in self.__dataclass_fields__})

    def summary(self) -> str:
        """Human-readable lines: the files, each check's outcome, the notes."""
        lines = [f"export {self.format}{' ' + self.quant if self.quant else ''}: "
                 f"{'passed' if self.passed else 'FAILED'} in {self.seconds:.1f}s"]
        lines += [f"  wrote {p}" for p in self.files]
        for name, check in self.checks.items():
            lines.append(f"  check {name}: {describe_check(check)}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def describe_check(check: Any) -> str:
    """One check's result as `key=value, ...` (and its first problem), as the CLI prints it."""
    data = asdict(check) if is_dataclass(check) else dict(check)
    keep = {k: v for k, v in data.items() if k not in ("sample", "mismatches", "problems") and v is not None}
    text = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in keep.items())
    for key in ("problems", "mismatches"):
        if data.get(key):
            text += f"; {key}: {data[key][0]}"
    return text


class ExportCheckError(KestrelError):
    """The export was written but failed its check; its files were removed. `.result` has details."""

    def __init__(self, message: str, result: ExportResult) -> None:
        super().__init__(message)
        self.result = result


class Staging:
    """A folder inside `out_dir` for files being written; `commit` moves them into `out_dir`."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.created_out = not out_dir.exists()
        out_dir.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=".kestrel-export-", dir=out_dir))

    def commit(self) -> list[Path]:
        final = []
        for path in sorted(self.dir.iterdir()):
            target = self.out_dir / path.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(path, target)
            final.append(target)
        self.dir.rmdir()
        return final

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.created_out and self.out_dir.exists() and not any(self.out_dir.iterdir()):
            self.out_dir.rmdir()


def check_disk_space(out_dir: Path, needed: int, what: str) -> None:
    """Raise before writing when the file system of `out_dir` has less than `needed` bytes free."""
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise KestrelError(
            f"not enough disk space for {what} in {out_dir}: needs about {needed / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} GiB free. Free some space or choose another --out folder"
        )


def export(source: str | Path, format: str, out_dir: str | Path, quant: str | None = None,
           progress: Progress | None = None, check: bool = True, device: str | None = None) -> ExportResult:
    """Export `source` (training output folder, adapter folder, model folder or `demo`) to `out_dir`.

    `format`: adapter | merged | gguf. `quant`: for gguf one of QUANT_TYPES (default f16); for
    merged the weights' dtype, one of MERGED_DTYPES (auto keeps the stored 16-bit dtype).
    `check=False` skips the comparison with the Hugging Face model (files are still validated).
    `device`: where merges, casts and the Hugging Face reference run (default: CUDA when present).
    Raises KestrelError on bad input, ExportCheckError when the written files fail their check.
    """
    from kestrel.export.formats import export_adapter, export_gguf, export_merged
    from kestrel.export.source import resolve_source

    if format not in FORMATS:
        raise KestrelError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    if format == "gguf":
        quant = check_quant(quant)
    elif format == "merged":
        quant = (quant or "auto").lower()
        if quant not in MERGED_DTYPES:
            raise KestrelError(f"merged weights can be {', '.join(MERGED_DTYPES)}; got {quant!r}")
    elif quant is not None:
        raise KestrelError("--quant applies to gguf (quantization type) and merged (dtype) exports only")
    start = time.perf_counter()
    src = resolve_source(source)
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise KestrelError(f"--out {out} is a file; give a folder to write into")
    result = ExportResult(format=format, out_dir=out, quant=quant, notes=list(src.notes))
    report = progress or (lambda fraction, message: None)
    staging = Staging(out)
    try:
        writer = {"adapter": export_adapter, "merged": export_merged, "gguf": export_gguf}[format]
        writer(src, staging.dir, result, report, check, device)
        if not result.passed:
            result.seconds = time.perf_counter() - start
            raise ExportCheckError(f"the exported {format} failed its check; nothing was kept.\n{result.summary()}", result)
        result.seconds = time.perf_counter() - start
        result.files = [out / p.name for p in sorted(staging.dir.iterdir())] + [out / "export.json"]
        (staging.dir / "export.json").write_text(json.dumps(result.to_dict(), indent=2))
        result.files = staging.commit()
        report(1.0, "done")
    except BaseException:
        staging.abort()
        result.files = []
        raise
    result.seconds = time.perf_counter() - start
    return result
