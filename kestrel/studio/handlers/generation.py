"""The Runs tab's generation check: the held-out prompts a run answered at its end, beside their
reference answers, with exact match and ROUGE-L (`kestrel.training.generation_check` wrote them).

    generation_view(job)  -> {"generation_summary": markdown, "generation_table": DataFrame}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from kestrel import jobs
from kestrel.studio import strings as S
from kestrel.training.generation_check import GENERATION_FILE

OUTPUTS = ("generation_summary", "generation_table")


def _read(job: jobs.Job | None) -> dict[str, Any] | None:
    if job is None or not job.output_dir:
        return None
    try:
        data = json.loads((Path(job.output_dir) / GENERATION_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("rows"), list) else None


def generation_view(job: jobs.Job | None) -> dict[str, Any]:
    """The summary line and one table row per prompt (prompt, reference, answer, scores)."""
    data = _read(job)
    if data is None:
        return {"generation_summary": S.RU_GEN_NONE, "generation_table": pd.DataFrame(columns=S.RU_GEN_COLUMNS)}
    rows = [[r.get("prompt", ""), r.get("reference", ""), r.get("answer", ""),
             "yes" if r.get("exact_match") else "no", round(float(r.get("rouge_l", 0.0)), 3)] for r in data["rows"]]
    summary = S.RU_GEN_SUMMARY.format(n=len(rows), step=data.get("step", "?"),
                                      exact=float(data.get("exact_match", 0.0)), rouge=float(data.get("rouge_l", 0.0)))
    return {"generation_summary": summary, "generation_table": pd.DataFrame(rows, columns=S.RU_GEN_COLUMNS)}
