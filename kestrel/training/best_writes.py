"""Writing the best weights so far (`RUN/best/`) without holding training up.

An evaluation that beats the best so far keeps its weights. For an adapter (a PEFT model on one
device) the adapter's tensors are copied to host memory, a copy of a few hundred MB at most and
the only part training waits for (the tensors are found once a run: `adapter_entries`), and a
background thread writes the folder and then the marker, while the next steps run. A full model
(its host copy would be the size of the model) and a model sharded over several devices (its
gather is a collective) are written at once, as before.

One write at a time: the next save first waits for the one before (which had an evaluation
interval to finish) and raises its error, if it failed, as the `CheckpointWriteError` a save at
once would have raised. The recipe reports a finished write (`written`) to its callbacks, and
waits for the last one at the end of the run.

    writes = BestWrites(output_dir)
    writes.save(step, "eval_loss", 0.53, model, tokenizer)   # returns once the host copy is taken
    writes.written(wait=False) -> step of a completed, not yet reported write, or None
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kestrel.training.best import BEST_DIR, BEST_MARKER, write_marker
from kestrel.training.checkpoints import is_peft, save_weights, sharded
from kestrel.training.distributed import World


def adapter_entries(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The entries of `model.state_dict()` its adapter files hold (what PEFT's save keeps for
    each of its adapters), as the live parameters; None for a model that is not a PEFT model on
    one device. Matched by storage, so whatever PEFT keeps (LoRA's A and B, DoRA's magnitudes,
    saved embeddings) is found, under the names PEFT's save looks for. A walk of the whole state
    (a quantized base packs its quantization state there, with a device read per layer): a run
    does it once."""
    if not is_peft(model) or sharded(model):
        return None
    from peft.utils import get_peft_model_state_dict

    kept: set[int] = set()
    for name in model.peft_config:
        kept |= {t.data_ptr() for t in get_peft_model_state_dict(model, adapter_name=name).values()
                 if isinstance(t, torch.Tensor)}
    return {k: v for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor) and v.data_ptr() in kept}


def host_copy(entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`entries`' values as they are now, copied to the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in entries.items()}


class BestWrites:
    """The best-weights folder of one run: its writes, one at a time (see the module)."""

    def __init__(self, output_dir: Path) -> None:
        self.folder = Path(output_dir) / BEST_DIR
        self.output_dir = Path(output_dir)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: int | None = None  # the step of a completed write not yet reported
        self._lock = threading.Lock()  # _done: set by the writing thread, taken by `written`
        self._entries: tuple[int, dict[str, torch.Tensor] | None] | None = None  # (id(model), its adapter_entries)

    def save(self, step: int, metric: str, value: float, model: nn.Module, tokenizer: Any,
             world: World | None = None) -> None:
        """Keep `model`'s weights as the best (evaluated at `step`, `metric` = `value`). The marker
        is removed first and written after the weights: it always describes complete weights.
        On several devices every rank calls it (FSDP2 gathers the shards); rank 0 writes."""
        self.wait()
        main = world is None or world.is_main
        if main:
            (self.folder / BEST_MARKER).unlink(missing_ok=True)
            self.folder.mkdir(parents=True, exist_ok=True)
        entries = self._adapter_entries(model) if world is None or world.size == 1 else None
        snapshot = host_copy(entries) if entries is not None else None
        if snapshot is None:
            save_weights(model, self.folder, tokenizer, world)
            if main:
                write_marker(self.output_dir, step, metric, value)
            with self._lock:
                self._done = step
            return

        def write() -> None:
            save_weights(model, self.folder, tokenizer, weights=snapshot)
            write_marker(self.output_dir, step, metric, value)

        self._thread = threading.Thread(target=self._run, args=(write, step), name="kestrel-best-weights")
        self._thread.start()

    def _adapter_entries(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        if self._entries is None or self._entries[0] != id(model):
            self._entries = (id(model), adapter_entries(model))
        return self._entries[1]

    def _run(self, write: Any, step: int) -> None:
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread by wait()
            self._error = exc
            return
        with self._lock:
            self._done = step

    def wait(self) -> None:
        """Until the write in flight (if any) is done; raises its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def written(self, wait: bool) -> int | None:
        """The step whose weights a completed write kept, once (None when there is none new);
        with `wait`, the write in flight is waited for first. Raises a failed write's error."""
        if wait or (self._thread is not None and not self._thread.is_alive()):
            self.wait()
        with self._lock:
            done, self._done = self._done, None
        return done
