"""Export tab handlers over export jobs: Export submits a job that a worker process runs; the
progress, the files to download and the Modelfile come from the store, so a closed page or a
restarted studio (to the handlers: a new call) finds the same export again.

The run to export is a LoRA adapter of the demo model built once for the module; the exports
are the fast ones (GGUF q8_0 written directly, the adapter zipped)."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
import zipfile
from html import unescape
from pathlib import Path

import gradio as gr
import pytest
from sqlalchemy import update

from kestrel import jobs
from kestrel.jobs.models import Job
from kestrel.jobs.queries import record_artifact, write_metrics
from kestrel.jobs.store import session
from kestrel.studio import files
from kestrel.studio.handlers import export
from tests.jobs.exportkit import finished_run_in
from tests.studio.helpers import error_text, wait_for

SHARED_HOME = True  # the run is built once for this module
SLOW = 300.0  # a worker imports torch and loads the demo model: seconds on a busy CPU


@pytest.fixture(scope="module")
def finished_run(module_home: Path) -> int:
    return finished_run_in(module_home)


def _pretend(job_id: int, **values: object) -> None:
    """Set columns of a job as a worker would (no process: these tests read the store only)."""
    with session(immediate=True) as s:
        s.execute(update(Job).where(Job.id == job_id).values(**values))


def test_progress_and_queue_come_from_the_store(finished_run: int) -> None:
    config = export.export_config(f"run:{finished_run}", "gguf", "q4_k_m")
    running = jobs.submit(config, start=False)
    # Running with a fresh heartbeat and no pid: the scheduler leaves it alone for a few seconds.
    _pretend(running, status="running", device="cpu", heartbeat_at=time.time(), total_steps=100)
    write_metrics(running, [(45, "progress", 0.45)], stage="writing f16 GGUF")
    waiting = export.start_export(f"run:{finished_run}", "gguf", "q8_0")  # the export slot is taken
    view = export.export_view(running)
    assert "45% · writing f16 GGUF" in view["status"] and view["file"] is None and view["modelfile"] == ""
    assert export.export_view(waiting)["status"] == f"Export #{waiting} is queued: it starts when the export before it ends."
    # Pressing Export again, here or on a page opened after a restart, follows the same job.
    assert export.start_export(f"run:{finished_run}", "gguf", "q4_k_m") == running
    listed = export.recent_exports()
    assert f"| {waiting} | run-{finished_run}-gguf-q8_0 | queued |" in listed
    assert f"| {running} | run-{finished_run}-gguf-q4_k_m | 45% · writing f16 GGUF |" in listed
    _pretend(running, status="failed", error="the exported gguf failed its check; nothing was kept.")
    assert "failed its check" in export.export_view(running)["status"]
    jobs.cancel(waiting)
    assert "was cancelled before it finished" in export.export_view(waiting)["status"]


def test_gguf_export_goes_on_after_the_page_closes_and_is_found_again(finished_run: int, module_home: Path) -> None:
    relay = export.run_export(f"run:{finished_run}", "final", "gguf", "q8_0")
    first = next(relay)
    assert first["status"].startswith(("`░", "Export #")) and first["file"] is None
    relay.close()  # the page went away: only the relay stops
    job_id = jobs.list_jobs(kind="export")[0].id
    wait_for(lambda: jobs.get_job(job_id).status in jobs.FINISHED, SLOW, "the export to finish")
    assert jobs.get_job(job_id).status == "completed", jobs.log_tail(job_id)
    view = export.export_view(job_id)  # a new call, as from a reopened page or a restarted studio
    gguf, modelfile = map(Path, view["file"])
    assert gguf.suffix == ".gguf" and gguf.read_bytes()[:4] == b"GGUF" and modelfile.name == "Modelfile"
    assert gguf.parent == Path(jobs.get_job(job_id).output_dir) and gguf.parent.parent == module_home / "exports"
    assert [a.path for a in jobs.list_artifacts(job_id, "gguf")] == [str(gguf)]  # served: the artifact itself
    assert view["modelfile"] == modelfile.read_text() and f"FROM ./{gguf.name}" in view["modelfile"]
    assert "Exported in" in view["status"]
    assert "- tokenizer: **passed**" in view["status"] and "- gguf_q8_0: **passed** · " in view["status"]
    assert "- chat_template: embedded=True" in view["status"]
    listed = export.recent_exports()
    assert f"| {job_id} | run-{finished_run}-gguf-q8_0 | completed |" in listed
    assert f'download="{gguf.name}"' in listed and 'download="Modelfile"' in listed


def test_adapter_export_downloads_one_zip(finished_run: int) -> None:
    outs = list(export.run_export(f"run:{finished_run}", "final", "adapter", None))
    final = outs[-1]
    assert "Exported" in final["status"], final["status"]
    (archive,) = map(Path, final["file"])
    job = jobs.list_jobs(kind="export")[0]
    assert archive.suffix == ".zip" and archive.parent == Path(job.output_dir)
    assert [a.path for a in jobs.list_artifacts(job.id, "archive")] == [str(archive)]
    names = set(zipfile.ZipFile(archive).namelist())
    assert {"adapter_config.json", "adapter_model.safetensors", "export.json"} <= names
    assert final["modelfile"] == ""


def test_export_errors_are_messages(finished_run: int) -> None:
    queued = jobs.submit({"model": "demo", "dataset": "arithmetic_chat", "max_steps": 1}, start=False)
    cases = [(f"run:{queued}", "gguf", "q4_k_m", "only completed runs"),
             (f"run:{finished_run}", "gguf", "q9_z", "q9_z"), ("", "gguf", "q4_k_m", "No finished run")]
    for source, fmt, quant, words in cases:
        with pytest.raises(gr.Error) as excinfo:
            list(export.run_export(source, None, fmt, quant))
        assert words in error_text(excinfo)
    jobs.cancel(queued)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_download_links_are_served_by_the_studio(finished_run: int) -> None:
    """The link under Recent exports fetches the artifact file through Gradio's file route."""
    job_id = jobs.submit(export.export_config(f"run:{finished_run}", "gguf", "f16"), start=False)
    out = Path(jobs.get_job(job_id).output_dir)
    (out / "tuned-f16.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)
    record_artifact(job_id, "gguf", out / "tuned-f16.gguf")
    _pretend(job_id, status="completed", started_at=time.time() - 3, finished_at=time.time())
    href = re.search(r'href="([^"]+tuned-f16\.gguf)"', export.recent_exports()).group(1)
    with gr.Blocks() as app:
        gr.Markdown("studio")
    port = _free_port()
    app.launch(server_port=port, prevent_thread_lock=True, allowed_paths=files.served_dirs(), quiet=True)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/{unescape(href)}", timeout=30).read()
    finally:
        app.close()
    assert body == (out / "tuned-f16.gguf").read_bytes()
