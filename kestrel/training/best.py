"""The best-weights marker of a run folder, readable without torch (the export reads it).

    RUN/best/adapter/ (or model/), RUN/best/best.json  {"step", "metric", "value"}

Written by `kestrel.training.evaluation.Evaluator.save_best`: the marker goes after the weights
and is removed before they are replaced, so a marker always describes complete weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BEST_DIR = "best"
BEST_MARKER = "best.json"


def read_best(output_dir: Path) -> dict[str, Any] | None:
    """{"step", "metric", "value", "path" (the weights folder)} of a run's best weights, or None
    when there is no marker, it is unreadable, or its weights are missing."""
    marker = Path(output_dir) / BEST_DIR / BEST_MARKER
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    weights = next((marker.parent / name for name in ("adapter", "model") if (marker.parent / name).is_dir()), None)
    if not isinstance(data, dict) or weights is None or not {"step", "metric", "value"} <= set(data):
        return None
    return {**data, "path": str(weights)}


def write_marker(output_dir: Path, step: int, metric: str, value: float) -> None:
    (Path(output_dir) / BEST_DIR / BEST_MARKER).write_text(json.dumps({"step": step, "metric": metric, "value": value}) + "\n")
