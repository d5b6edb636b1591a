"""Gradient checkpointing: off, standard (recompute each decoder layer), or offload.

Both modes use one reentrant autograd Function per decoder layer: the layer runs under no_grad
and only its input is kept. (torch's non-reentrant checkpoint installs saved-tensor hooks on every
op of the layer; on an 8B QLoRA step that host overhead left the GPU idle a quarter of the time.)

Standard keeps the layer input on the GPU. Offload keeps only each decoder layer's input, and
keeps it in pinned CPU memory: the copy out runs on a side stream while the next layers compute,
and the copy back of each layer's input starts when the layer above begins its backward
(`_HostCopy`). GPU memory for activations then no longer grows with the number of layers, which
is what lets long contexts fit.
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any, Callable

import torch
from torch import nn

# True while a checkpointed layer is re-run for its backward: its output's values are thrown
# away (only its graph is used), which the decoder layer forward uses to skip the MLP's last
# product (`kernels.lora_mlp(discard_output=True)`). A context variable: backward runs on
# autograd's own thread.
_RECOMPUTING = contextvars.ContextVar("kestrel_recomputing", default=False)


def recomputing() -> bool:
    """Whether the code running now is a checkpointed layer's recompute for backward."""
    return _RECOMPUTING.get()


class _HostCopy:
    """One layer input kept in pinned host memory (offloaded checkpointing).

    On CUDA both copies run on a side stream, so neither holds up the compute stream: the copy
    out starts once the input is written and overlaps the next layers; the copy back of the
    layer below is started when this layer's backward begins (`prefetch`), so it overlaps this
    layer's recompute and backward. Each copy knows the one made just before it in the forward
    (weakly: a finished step's copies are gone once their graph is).
    """

    _last: weakref.ref | None = None  # the copy made most recently (the layer below the next)

    def __init__(self, hidden: torch.Tensor) -> None:
        self.device, self.fetched, self.ready = hidden.device, None, None
        self.below, _HostCopy._last = _HostCopy._last, weakref.ref(self)
        self.host: torch.Tensor | None = torch.empty(
            hidden.shape, dtype=hidden.dtype, device="cpu", pin_memory=hidden.is_cuda
        )
        if not hidden.is_cuda:
            self.host.copy_(hidden.detach())
            return
        side = _side_stream(hidden.device)
        side.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(side):
            self.host.copy_(hidden.detach(), non_blocking=True)
        hidden.record_stream(side)  # its memory is not reused before the copy has read it

    def prefetch(self) -> None:
        """Start the copy back to the device (CUDA), once."""
        if self.fetched is not None or self.host is None or self.device.type != "cuda":
            return
        side = _side_stream(self.device)
        with torch.cuda.stream(side):
            self.fetched = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(side)

    def take(self) -> torch.Tensor:
        """The input back on its device, for the compute stream; then start the layer below's."""
        if self.device.type != "cuda":
            out = self.host.to(self.device)
        else:
            self.prefetch()
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.ready)
            out = self.fetched
            out.record_stream(current)  # made on the side stream, used and freed on this one
        self.host = self.fetched = None
        below = self.below() if self.below is not None else None
        if below is not None:
            below.prefetch()
        return out


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class LayerCheckpoint(torch.autograd.Function):
    """y = layer(x), keeping only x (on the GPU, or in pinned CPU memory when offloading,
    `_HostCopy`); backward recomputes the layer from x.

    Backward: x is brought back (copied to the device when offloaded), the layer is re-run with
    autograd on (`recomputing()` is True meanwhile: y's values are not used, only its graph),
    and `torch.autograd.backward(y, dy)` accumulates the parameter gradients and gives dx.
    """

    @staticmethod
    def forward(
        ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], offload: bool, hidden: torch.Tensor
    ) -> torch.Tensor:
        ctx.run, ctx.saved_input = run, (_HostCopy(hidden) if offload else hidden.detach())
        with torch.no_grad():
            return run(hidden)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        saved, ctx.saved_input = ctx.saved_input, None
        hidden = saved.take() if isinstance(saved, _HostCopy) else saved
        hidden = hidden.detach().requires_grad_(True)
        token = _RECOMPUTING.set(True)
        try:
            with torch.enable_grad():
                out = ctx.run(hidden)
        finally:
            _RECOMPUTING.reset(token)
        torch.autograd.backward(out, grad_out)
        return None, None, hidden.grad


def _checkpoint_func(offload: bool) -> Callable[..., torch.Tensor]:
    def checkpointed(run: Callable[..., torch.Tensor], hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        """The `_gradient_checkpointing_func` Hugging Face's decoder layers call (hidden first)."""
        fn = (lambda h: run(h, *args)) if args else run
        return LayerCheckpoint.apply(fn, offload, hidden)

    return checkpointed


recompute_checkpoint = _checkpoint_func(offload=False)
offloaded_checkpoint = _checkpoint_func(offload=True)


def set_gradient_checkpointing(model: nn.Module, mode: str) -> None:
    """Turn checkpointing `off`, `standard` (non-reentrant recompute) or `offload` on `model`."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if mode == "off":
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # The function is reentrant: its input must require grad for its backward to run even when
    # the embeddings are frozen (LoRA).
    model.enable_input_require_grads()
    func = offloaded_checkpoint if mode == "offload" else recompute_checkpoint
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer):
            layer._gradient_checkpointing_func = func
