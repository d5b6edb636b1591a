"""The one entry point every front end calls to train: `run(config, callbacks)`.

It resolves the output folder, writes the resolved config, runs SFT or GRPO, and turns failures
into a `TrainResult` the caller can show: out-of-memory names what to lower; a failed checkpoint
write (any writer's error, see `kestrel.training.checkpoints`) says which checkpoint is intact and
how much disk space to free; a full disk anywhere else says the same. Running the same config
again resumes from the latest checkpoint in `output_dir`, after removing the `.tmp` folders a
process killed mid-save left behind (logged).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kestrel.constants import slug
from kestrel.recompute.host_memory import release_pinned_memory
from kestrel.config import TrainConfig, check_output_dir, expand_path
from kestrel.errors import ConfigError, KestrelError, OutOfMemoryError, oom_message
from kestrel.training.cuda_allocator import apply_cuda_allocator
from kestrel.training.checkpoints import (
    describe, free_bytes, latest_checkpoint, looks_like_full_disk, remove_stale_writes,
)
from kestrel.training.distributed import World, join, leave, plan_devices, world_from_env
from kestrel.training.launch import RankGroup
from kestrel.training.metrics import Callback, CallbackList
from kestrel.training.reporters import metric_sinks
from kestrel.paths import model_stem, runs_dir

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    status: str  # completed | cancelled | interrupted | failed
    output_dir: str
    step: int
    error: str | None = None


def default_run_name(config: TrainConfig) -> str:
    base = slug(model_stem(str(config.model)), "model")
    return f"{base}-{config.method}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_output_dir(config: TrainConfig) -> Path:
    """`output_dir` as given, or KESTREL_HOME/runs/<name>; written back into the config, and
    created. ConfigError when it is a file or cannot be created."""
    if not config.output_dir:
        config.name = config.name or default_run_name(config)
        config.output_dir = str(runs_dir() / config.name)
    check_output_dir(config.output_dir)
    out = expand_path(config.output_dir, "output_dir")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output_dir {out} cannot be created: {exc.strerror or exc}") from None
    return out


def _release_memory() -> None:
    gc.collect()  # first: a failed step's graph gives its offloaded layer inputs' buffers back
    release_pinned_memory()  # page-locked host memory of offloaded checkpointing (up to ~100 GB)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _clean_stale_writes(output_dir: Path, cb: Callback) -> None:
    """Remove what a run killed mid-save left (`step-N.tmp`, `adapter.tmp`), saying so."""
    for path in remove_stale_writes(output_dir):
        cb.on_log(f"removed {path}: an unfinished save left by an earlier run that was stopped while saving")


def disk_full_message(output_dir: Path, exc: OSError) -> str:
    """A full disk met outside a checkpoint (metrics, config): what failed, what is intact, the
    free space."""
    free = free_bytes(output_dir)
    previous = latest_checkpoint(output_dir)
    kept = f"the checkpoint {previous.name} is intact" if previous else "no checkpoint was written yet"
    space = f"{free / 1e6:.1f} MB free there" if free is not None else "free space unknown"
    return (f"the disk holding {output_dir} is full ({describe(exc)}; {space}); {kept}. "
            "Free disk space, then resume the run.")


def _train(config: TrainConfig, output_dir: Path, cb: Callback, world: World) -> tuple[str, int]:
    if config.method == "grpo":
        from kestrel.training.grpo import run_grpo

        return run_grpo(config, output_dir, cb, world)
    if config.is_preference:
        from kestrel.training.preference import run_preference

        return run_preference(config, output_dir, cb, world)
    from kestrel.training.sft import run_sft

    return run_sft(config, output_dir, cb, world)


def _failure_message(exc: Exception, config: TrainConfig, output_dir: Path, group: RankGroup | None) -> str:
    """The message of a failed run: out of memory names what to lower, a full disk what to free, a
    rank that died which one and why; an unknown error is raised again (a bug to see in full)."""
    if group is not None:
        failure = group.wait_for_failure()
        if failure is not None:
            return failure
    if isinstance(exc, torch.OutOfMemoryError):
        return str(OutOfMemoryError(oom_message(config.batch_size, config.max_seq_length, config.gradient_checkpointing)))
    if isinstance(exc, KestrelError):
        return str(exc)
    if isinstance(exc, OSError) and looks_like_full_disk(exc):
        return disk_full_message(output_dir, exc)
    raise exc


def _end_stuck(cb: Callback, group: RankGroup, message: str) -> None:
    """A rank died and rank 0 stays blocked in a collective (NCCL may never time out): report the
    failure, stop the other ranks and end this process."""
    try:
        cb.on_end("failed", message)
    finally:
        group.kill()
        os._exit(1)


def run(config: TrainConfig, callbacks: list[Callback] | None = None) -> TrainResult:
    """Train as `config` says, reporting to `callbacks`; never raises for a run that failed (a
    ConfigError when the output folder cannot be made or `devices` names GPUs that are not
    there: then nothing ran).

    With several `devices`, this process is rank 0: it starts the other ranks
    (`kestrel.training.launch`), and alone reports and writes. A process started as another
    rank (RANK > 0 in its environment) trains its share and reports nothing."""
    allocator = apply_cuda_allocator(config.performance.cuda_allocator)  # before anything reserves CUDA memory
    world = world_from_env()
    devices = plan_devices(config.devices, torch.cuda.device_count()) if not world.distributed else []
    output_dir = resolve_output_dir(config)
    main = world.is_main
    cb = CallbackList([*metric_sinks(config, output_dir), *(callbacks or [])] if main else [])
    step, error, group, status = 0, None, None, "failed"
    try:
        if main:
            config.save(output_dir / "config.yaml")
            _clean_stale_writes(output_dir, cb)
            cb.on_log(f"CUDA allocator: {allocator}")
        if len(devices) > 1:
            group = RankGroup(output_dir / "config.yaml", devices, output_dir)
            group.start_watching(lambda message: _end_stuck(cb, group, message))
            world = group.world()
            cb.on_log(f"training on {len(devices)} devices ({', '.join(devices)}); ranks 1..{len(devices) - 1} "
                      f"log to {output_dir}/rank-N.log")
        join(world)
        status, step = _train(config, output_dir, cb, world)
    except Exception as exc:  # noqa: BLE001 - sorted below: known failures become a result, the rest is raised
        status, error = "failed", _failure_message(exc, config, output_dir, group)
    finally:
        if group is not None:  # the other ranks end with this one; after a failure they are stopped
            group.finish() if status != "failed" else group.kill()
        leave(world)
    # Outside the except block: the traceback (and the frames holding the model) is gone, so
    # collecting here really gives the GPU memory back.
    _release_memory()
    try:
        cb.on_end(status, error)
    except Exception as exc:  # noqa: BLE001 - a watcher that cannot record the end must not hide the result
        log.warning("could not report the end of the run: %s", describe(exc))
    return TrainResult(status, str(output_dir), step, error)
