"""Export tab handlers: a finished run (or the demo model) to a LoRA adapter, a merged 16-bit
model or a GGUF file with its Ollama Modelfile, with progress, then a file to download.

Exports land in KESTREL_HOME/exports/<run>-<format>[-<quant>]/. The export runs on its own
thread, so it completes even if the browser goes away; the handler only relays its progress.

    for out in run_export("run:3", "gguf", "q4_k_m"):
        out["status"]            # progress, then the summary
    out["file"], out["modelfile"]
"""

from __future__ import annotations

import html
import queue
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr

import jobs
from engine.errors import KestrelError
from engine.export import MERGED_DTYPES, QUANT_TYPES
from studio import files
from studio import strings as S
from studio.handlers.chat import finished_runs
from studio.handlers.common import DEMO, user_errors

ZIP_LIMIT = 2 * 2**30  # folders above this are not zipped for the browser


def source_choices() -> list[tuple[str, str]]:
    runs = [(S.CH_RUN_CHOICE.format(job=j.id, name=j.name or ""), f"run:{j.id}") for j in finished_runs()]
    return runs + [(S.CH_BASE_CHOICE.format(model=DEMO), f"base:{DEMO}")]


def refresh_sources(current: str | None) -> dict[str, Any]:
    choices = source_choices()
    values = [v for _, v in choices]
    return {"source": gr.update(choices=choices, value=current if current in values else values[0])}


def quant_choices(fmt: str) -> dict[str, Any]:
    """The quantization dropdown for a format (hidden for the adapter)."""
    if fmt == "gguf":
        return {"quant": gr.update(choices=list(QUANT_TYPES), value="q4_k_m", visible=True)}
    if fmt == "merged":
        return {"quant": gr.update(choices=list(MERGED_DTYPES), value="auto", visible=True)}
    return {"quant": gr.update(visible=False, value=None)}


def _source(value: str) -> tuple[str, str]:
    """(export source path or `demo`, folder name stem) of a choice value."""
    kind, _, rest = (value or "").partition(":")
    if kind == "base" and rest == DEMO:
        return DEMO, DEMO
    if kind != "run":
        raise KestrelError(S.EX_NO_RUNS)
    job = jobs.get_job(int(rest))
    if job.status != "completed":
        raise KestrelError(S.ERR_EXPORT_NOT_DONE.format(job=job.id, status=job.status))
    return job.output_dir, f"job-{job.id}"


def _bar(fraction: float, message: str) -> str:
    filled = int(max(0.0, min(1.0, fraction)) * 20)
    return f"`{'█' * filled}{'░' * (20 - filled)}` {fraction:.0%} · {html.escape(message)}"


def _folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _download(result: Any, fmt: str, out: Path) -> tuple[list[str], str]:
    """(files to offer, extra note) for an export result: the GGUF and its Modelfile, or a zip
    of the adapter / merged folder (a merged model too large to zip stays a folder)."""
    if fmt == "gguf":
        keep = [p for p in result.files if Path(p).suffix == ".gguf" or Path(p).name == "Modelfile"]
        return sorted((str(p) for p in keep), key=lambda p: not p.endswith(".gguf")), ""
    if fmt == "merged" and _folder_size(out) > ZIP_LIMIT:
        return [], S.EX_FOLDER_ONLY.format(size=_folder_size(out) / 2**30, out=out)
    return [shutil.make_archive(str(out), "zip", root_dir=out)], ""


@user_errors
def run_export(source: str, fmt: str, quant: str | None) -> Iterator[dict[str, Any]]:
    """Export and relay progress. Outputs: status, file (paths to download), modelfile (text)."""
    from engine.export import export

    path, stem = _source(source)
    quant = quant if fmt in ("gguf", "merged") else None
    out = files.exports_dir() / "-".join(x for x in (stem, fmt, quant) if x)
    events: queue.Queue[tuple[str, Any]] = queue.Queue()

    def work() -> None:
        try:
            events.put(("done", export(path, fmt, out, quant=quant, progress=lambda f, m: events.put(("p", (f, m))))))
        except BaseException as exc:  # noqa: BLE001 - relayed to the handler, which raises it
            events.put(("error", exc))

    threading.Thread(target=work, name="export", daemon=True).start()
    skip = {"file": gr.skip(), "modelfile": gr.skip()}
    yield {"status": _bar(0.0, "starting"), **skip}
    while True:
        kind, payload = events.get()
        if kind == "p":
            yield {"status": _bar(*payload), **skip}
            continue
        if kind == "error":
            raise payload
        break
    result = payload
    download, note = _download(result, fmt, out)
    modelfile = out / "Modelfile"
    status = S.EX_DONE.format(seconds=result.seconds, out=out) + (f"\n\n{note}" if note else "")
    notes = "".join(f"\n- {html.escape(n)}" for n in result.notes)
    yield {"status": status + notes, "file": download or None,
           "modelfile": modelfile.read_text() if modelfile.is_file() else ""}
