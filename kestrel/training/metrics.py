"""The interface between a training run and whoever watches it.

The engine knows nothing of the job store: it reports through `Callback` objects. `kestrel.jobs` plugs in
a callback that writes to the database; the command line uses `JsonlWriter` and `ProgressBar`.

Metric names reported at each step (GRPO adds its own, e.g. `reward`, `kl`):
    step, total_steps, epoch, loss, lr, grad_norm, tokens_per_s (trained tokens, no padding),
    vram_alloc_gib, vram_reserved_gib, vram_peak_gib, elapsed_s, eta_s
    aux_loss: mixture-of-experts models only, the router's load-balancing loss (mean over the
    step's micro-batches; part of `loss` only when the model config sets output_router_logits)
With an evaluation set, a separate call at each evaluated step (TRL's names): step, eval_loss (and
the method's eval_* metrics), eval_runtime; at the end eval_exact_match and eval_rouge_l of the
generation check (`kestrel.training.evaluation`, `kestrel.training.generation_check`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

StopKind = Literal["cancel", "pause"]
METRICS_FILE = "metrics.jsonl"  # in the run folder


@dataclass
class RunInfo:
    """What a callback learns when a run starts."""

    output_dir: str
    total_steps: int
    start_step: int  # > 0 when resuming from a checkpoint
    device: str
    method: str


class Callback:
    """Receives a run's progress. Every method is optional; the defaults do nothing."""

    def on_start(self, info: RunInfo) -> None:
        """Called once, after the model and data are ready and before the first step."""

    def on_step(self, metrics: dict[str, float]) -> None:
        """Called after each optimizer step that is logged, with the metrics above."""

    def on_checkpoint(self, step: int, path: str) -> None:
        """Called after a checkpoint has been fully written to `path`."""

    def on_best(self, step: int, path: str) -> None:
        """Called after the best weights so far (evaluated at `step`) have been written to `path`
        (RUN/best, replacing the previous best)."""

    def on_log(self, message: str) -> None:
        """A one-line notice for the user (a fallback taken, rows truncated, ...)."""

    def on_end(self, status: str, error: str | None = None) -> None:
        """Called once: status is completed, cancelled, interrupted or failed."""

    def should_stop(self) -> StopKind | None:
        """Polled at each step boundary: "cancel" or "pause" ends the run after a checkpoint."""
        return None


class CallbackList(Callback):
    """Fans every call out to several callbacks."""

    def __init__(self, callbacks: list[Callback] | None = None) -> None:
        self.callbacks = list(callbacks or [])

    def on_start(self, info: RunInfo) -> None:
        for cb in self.callbacks:
            cb.on_start(info)

    def on_step(self, metrics: dict[str, float]) -> None:
        for cb in self.callbacks:
            cb.on_step(metrics)

    def on_checkpoint(self, step: int, path: str) -> None:
        for cb in self.callbacks:
            cb.on_checkpoint(step, path)

    def on_best(self, step: int, path: str) -> None:
        for cb in self.callbacks:
            cb.on_best(step, path)

    def on_log(self, message: str) -> None:
        for cb in self.callbacks:
            cb.on_log(message)

    def on_end(self, status: str, error: str | None = None) -> None:
        for cb in self.callbacks:
            cb.on_end(status, error)

    def should_stop(self) -> StopKind | None:
        for cb in self.callbacks:
            kind = cb.should_stop()
            if kind:
                return kind
        return None


class JsonlWriter(Callback):
    """Appends one JSON object per step to `output_dir/metrics.jsonl`.

    On resume it first drops rows past the resumed step, so a run that crashed after logging but
    before checkpointing does not leave duplicate steps behind.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def on_start(self, info: RunInfo) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= info.start_step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def on_step(self, metrics: dict[str, float]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


def read_series(path: Path, name: str, up_to: int) -> list[tuple[int, float]]:
    """(step, value) of metric `name` in a metrics.jsonl, at steps <= `up_to` (what a resumed
    run keeps); [] when the file is missing."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(int(r["step"]), float(r[name])) for r in rows if name in r and int(r.get("step", 0)) <= up_to]


class ProgressBar(Callback):
    """A tqdm bar on stderr with the loss and throughput."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_start(self, info: RunInfo) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=info.total_steps, initial=info.start_step, unit="step", dynamic_ncols=True)

    def on_step(self, metrics: dict[str, float]) -> None:
        if self.bar is None:
            return
        self.bar.n = int(metrics["step"])
        shown = {k: metrics[k] for k in ("loss", "eval_loss", "reward", "lr", "tokens_per_s") if k in metrics}
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=True)

    def on_log(self, message: str) -> None:
        from tqdm import tqdm

        tqdm.write(message)

    def on_end(self, status: str, error: str | None = None) -> None:
        if self.bar is not None:
            self.bar.close()


def memory_metrics(device: torch.device) -> dict[str, float]:
    """GPU memory allocated / reserved / peak in GiB (zeros on a CPU)."""
    if device.type != "cuda":
        return {"vram_alloc_gib": 0.0, "vram_reserved_gib": 0.0, "vram_peak_gib": 0.0}
    gib = float(1 << 30)
    return {
        "vram_alloc_gib": torch.cuda.memory_allocated(device) / gib,
        "vram_reserved_gib": torch.cuda.memory_reserved(device) / gib,
        "vram_peak_gib": torch.cuda.max_memory_allocated(device) / gib,
    }
