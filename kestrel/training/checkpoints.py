"""Training checkpoints: written atomically, found again on resume.

    output_dir/checkpoints/step-000040/
        adapter/ (PEFT) or model/ (full fine-tuning), optimizer.pt, scheduler.pt, state.json

A checkpoint is written into `step-N.tmp` and renamed when complete, so a crash or a full disk
never leaves a half-written checkpoint under a final name, and the previous one stays intact.
The final weights (`output_dir/adapter` or `output_dir/model`) are written the same way.

Whatever a writer raises (OSError from Python's files, SafetensorError from safetensors,
RuntimeError "unexpected pos" from `torch.save` on a full disk, anything else) becomes a
`CheckpointWriteError`: the partial folder is removed first (a full disk gets its space back),
and the message names the file that failed, the checkpoint that is intact, the space free on that
disk and about how much a checkpoint needs. A `.tmp` folder left by a process killed mid-save is
removed at the next start (`remove_stale_writes`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kestrel.errors import KestrelError
from kestrel.training.best import BEST_DIR

KEEP = 2  # checkpoints kept; older ones are removed once a newer one is complete
TMP_SUFFIX = ".tmp"
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
DISK_FULL_WORDS = ("no space left", "disk full", "quota exceeded", "file too large")

NEARLY_FULL_BYTES = 16 << 20  # a write that fails with less than this left is taken for a full disk

Writer = tuple[str, Callable[[], Any]]  # (what it writes, the call that writes it)
Failure = Callable[[str, Exception, bool], str]  # (what failed, the error, disk nearly full) -> message


class CheckpointWriteError(KestrelError):
    """A checkpoint or the final weights could not be written; the message says what failed,
    which checkpoint is intact and how much disk space to free."""


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards the model's parameters (a full fine-tune on several devices)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _full_states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict | None, dict | None]:
    """The whole model's (and optimizer's) state gathered from FSDP2's shards onto the CPU; every
    rank must call it (it is a collective). (None, None) for a model that is not sharded."""
    if not sharded(model):
        return None, None
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    return weights, (get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None)


def _weights_writers(model: nn.Module, target: Path, tokenizer: Any = None, weights: dict | None = None) -> list[Writer]:
    save = (lambda: model.save_pretrained(target)) if weights is None else (
        lambda: model.save_pretrained(target, state_dict=weights))  # FSDP2: the gathered full state
    writers: list[Writer] = [(f"{target.name}/ (the weights)", save)]
    if tokenizer is not None:
        writers.append((f"{target.name}/ (the tokenizer)", lambda: tokenizer.save_pretrained(target)))
    return writers


def save_weights(model: nn.Module, folder: Path, tokenizer: Any = None, world: Any = None,
                 weights: dict[str, torch.Tensor] | None = None) -> Path:
    """The adapter (PEFT folder) or the full model, plus the tokenizer, into `folder`/adapter or
    `folder`/model, written to a `.tmp` folder and renamed. Raises CheckpointWriteError. On
    several devices (`world`, a `kestrel.training.distributed.World`) every rank calls it and
    rank 0 writes. `weights`: the state to write instead of the model's own (a copy taken
    earlier: `kestrel.training.best_writes.host_copy`)."""
    target = folder / ("adapter" if is_peft(model) else "model")
    if weights is None:
        weights, _ = _full_states(model, None)
    if world is None or world.is_main:
        tmp = target.with_name(target.name + TMP_SUFFIX)
        failure = _failure(f"the final weights ({target.name}/)", folder, lambda: _weights_bytes(model))
        _write_atomically(tmp, target, _weights_writers(model, tmp, tokenizer, weights), failure)
    if world is not None:
        world.barrier()
    return target


def save_checkpoint(
    output_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any],
    world: Any = None,
) -> Path:
    """Write the checkpoint of `step` (weights, optimizer, scheduler, state) and keep the newest
    KEEP. Raises CheckpointWriteError, with the partial folder removed, when any write fails.
    On several devices (`world`) every rank calls it; rank 0 writes (FSDP2's shards gathered first)."""
    final = checkpoint_dir(output_dir, step)
    weights, optim_state = _full_states(model, optimizer)
    if world is not None and not world.is_main:
        world.barrier()
        return final
    root, tmp = final.parent, final.with_name(final.name + TMP_SUFFIX)
    inner = tmp / ("adapter" if is_peft(model) else "model")
    optim_state = optim_state if optim_state is not None else optimizer.state_dict()
    writers = [
        *_weights_writers(model, inner, weights=weights),
        ("optimizer.pt", lambda: torch.save(optim_state, tmp / "optimizer.pt")),
        ("scheduler.pt", lambda: torch.save(scheduler.state_dict(), tmp / "scheduler.pt")),
        ("state.json", lambda: (tmp / "state.json").write_text(json.dumps({**state, "step": step}))),
    ]
    need = lambda: _checkpoint_bytes(output_dir, model, optimizer)
    _write_atomically(tmp, final, writers, _failure(f"the checkpoint of step {step}", output_dir, need))
    for old in sorted(root.glob("step-*[0-9]"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    if world is not None:
        world.barrier()
    return final


def _write_atomically(tmp: Path, final: Path, writers: list[Writer], failure: Failure) -> None:
    """Run `writers` into the fresh folder `tmp`, then rename it to `final`. On any error the
    partial folder is removed first, then CheckpointWriteError(failure(what, error)) is raised;
    a KeyboardInterrupt or SystemExit also removes it and goes on as it was."""
    shutil.rmtree(tmp, ignore_errors=True)
    what = f"the folder {tmp.name}"
    try:
        tmp.mkdir(parents=True)
        for name, write in writers:
            what = name  # named in the error if this write fails
            write()
        what = f"the rename of {tmp.name} to {final.name}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException as exc:
        nearly_full = (free_bytes(tmp) or 0) < NEARLY_FULL_BYTES  # before the partial files go
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, Exception):
            raise
        raise CheckpointWriteError(failure(what, exc, nearly_full)) from exc


def _failure(subject: str, output_dir: Path, need: Callable[[], int]) -> Failure:
    """A function that words the error for a failed write of `subject` (see write_failure)."""
    return lambda what, exc, nearly_full: write_failure(subject, what, exc, output_dir, need(), nearly_full)


def write_failure(subject: str, what: str, exc: BaseException, output_dir: Path, need: int,
                  nearly_full: bool = False) -> str:
    """The message for a failed write: what failed and why, which checkpoint is intact, the space
    free on that disk (after the partial folder was removed) against what a checkpoint needs, and
    what to do. `nearly_full`: the disk had almost nothing left when the write failed (torch.save
    then says only "unexpected pos")."""
    previous = latest_checkpoint(output_dir)
    kept = (f"the previous checkpoint {previous.name} is intact ({previous})" if previous
            else "no earlier checkpoint exists, so a resumed run starts from step 0")
    free = free_bytes(output_dir)
    full = nearly_full or looks_like_full_disk(exc) or (free is not None and free < need)
    space = (f"{human_size(free)} free on the disk holding {output_dir}" if free is not None
             else f"the free space on the disk holding {output_dir} is unknown")
    if full:
        more = need - free if free is not None and free < need else need
        advice = (f"The disk is full: {space}, and a checkpoint needs about {human_size(need)}; "
                  f"free at least {human_size(more)} there, then resume the run.")
    else:
        advice = f"Fix the cause and resume the run ({space}; a checkpoint needs about {human_size(need)})."
    return f"could not write {subject}: writing {what} failed ({describe(exc)}); {kept}. {advice}"


def describe(exc: BaseException) -> str:
    """An exception in one short line: OSError's own words, else the type and the first line."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def looks_like_full_disk(exc: BaseException) -> bool:
    """Whether an error (or one it was raised from) says the disk or the quota is full."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return True
        if any(word in str(seen).lower() for word in DISK_FULL_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def free_bytes(path: Path) -> int | None:
    """Free bytes on the disk holding `path` (its nearest existing parent); None if unknown."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def human_size(n: float | None) -> str:
    """`512 bytes`, `1.5 MB`, `4.2 GB` (powers of 1000), `?` when unknown."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("bytes", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _weights_bytes(model: nn.Module) -> int:
    """What save_pretrained writes: the trainable tensors of an adapter, every weight otherwise."""
    params = [p for p in model.parameters() if p.requires_grad or not is_peft(model)]
    return sum(p.numel() * p.element_size() for p in params)


def _checkpoint_bytes(output_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """About what one checkpoint takes: the last complete one's size, else the weights plus the
    optimizer's state tensors."""
    previous = latest_checkpoint(output_dir)
    if previous is not None:
        try:
            return _folder_bytes(previous)
        except OSError:
            pass
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return _weights_bytes(model) + sum(t.numel() * t.element_size() for t in state)


def remove_stale_writes(output_dir: Path) -> list[Path]:
    """Remove `.tmp` folders a killed process left mid-save (checkpoints, final and best weights);
    returns what was removed. Call only while no other process writes into `output_dir`."""
    candidates = [*(output_dir / "checkpoints").glob(f"step-*{TMP_SUFFIX}"),
                  *(folder / f"{name}{TMP_SUFFIX}" for folder in (output_dir, output_dir / BEST_DIR)
                    for name in ("adapter", "model"))]
    removed = []
    for path in sorted(candidates):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives (complete or not)."""
    return output_dir / "checkpoints" / f"step-{step:06d}"


def complete_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    done = [p for p in sorted((output_dir / "checkpoints").glob("step-*[0-9]")) if (p / "state.json").is_file()]
    return [(int(p.name[5:]), p) for p in done]


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1][1] if done else None


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """Restore weights, optimizer and scheduler from `path`; returns its state dict (with `step`)."""
    from safetensors.torch import load_file

    device = next(p for p in model.parameters()).device
    if is_peft(model):
        from peft import set_peft_model_state_dict

        weights = load_file(str(path / "adapter" / "adapter_model.safetensors"), device=str(device))
        set_peft_model_state_dict(model, weights)
    elif sharded(model):
        return _load_sharded(path, model, optimizer, scheduler)
    else:
        loaded = type(model).from_pretrained(path / "model", dtype=next(model.parameters()).dtype, use_safetensors=True)
        model.load_state_dict(loaded.state_dict())
    # Kestrel's own files in the run's folder (optimizer moments, scheduler counters: nested dicts
    # safetensors cannot hold), read with torch's restricted loader; never weights a user supplies.
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    return json.loads((path / "state.json").read_text())


def _load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """A full checkpoint (as `save_checkpoint` writes it) loaded into FSDP2's shards: every rank
    reads the whole files and keeps its own shard."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted((path / "model").glob("*.safetensors")):
        weights.update(load_file(str(file)))
    set_model_state_dict(model, weights, options=options)
    optim_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    return json.loads((path / "state.json").read_text())
