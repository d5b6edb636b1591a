"""Kestrel's job store and background runner.

The studio and scripts call this API; `python -m kestrel jobs` is the command line over the same calls.

    import jobs
    job_id = jobs.submit({"model": "demo", "dataset": "arithmetic_chat", "max_steps": 20})
    jobs.get_job(job_id).status             # queued | running | completed | failed | ...
    jobs.metrics_after(job_id, step=10)     # rows past step 10, for cheap polling
    jobs.metric_series(job_id, ["loss"], max_points=500)
    jobs.cancel(job_id); jobs.pause(job_id); jobs.resume(job_id); jobs.delete(job_id)
    export_id = jobs.submit({"kind": "export", "source": job_id, "format": "gguf", "quant": "q4_k_m"})
    jobs.get_job(export_id).step, .stage     # percent done and what it is doing; files: list_artifacts
"""

from kestrel.jobs.models import FINISHED, STATUSES, Artifact, Dataset, Job, Metric
from kestrel.jobs.queries import (
    MetricPoint, add_dataset, attempt_start_step, job_summary, latest_metrics, list_artifacts, list_datasets,
    metric_series, metrics_after, saved_mapping,
)
from kestrel.jobs.runner import (
    available_devices, cancel, delete, follow_log, get_job, list_jobs, log_tail, pause, reconcile, resume, schedule,
    submit, wait,
)
from kestrel.jobs.store import JobError, session

__all__ = [
    "Artifact", "Dataset", "FINISHED", "Job", "JobError", "Metric", "MetricPoint", "STATUSES",
    "add_dataset", "attempt_start_step", "available_devices", "cancel", "delete", "follow_log", "get_job", "job_summary",
    "latest_metrics", "list_artifacts", "list_datasets", "list_jobs", "log_tail", "metric_series",
    "metrics_after", "pause", "saved_mapping", "reconcile", "resume", "schedule", "session", "submit", "wait",
]
