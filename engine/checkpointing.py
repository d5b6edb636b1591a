"""Gradient checkpointing: off, standard (recompute each decoder layer), or offload.

Both modes use one reentrant autograd Function per decoder layer: the layer runs under no_grad
and only its input is kept. (torch's non-reentrant checkpoint installs saved-tensor hooks on every
op of the layer; on an 8B QLoRA step that host overhead left the GPU idle a quarter of the time.)

Standard keeps the layer input on the GPU. Offload keeps only each decoder layer's input, and keeps it in pinned CPU memory: the copy out is
queued on the compute stream right after the layer runs (it overlaps the next layers), and the
copy back is queued at the start of that layer's backward. GPU memory for activations then no
longer grows with the number of layers, which is what lets long contexts fit.
"""

from __future__ import annotations

import contextvars
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


class LayerCheckpoint(torch.autograd.Function):
    """y = layer(x), keeping only x (on the GPU, or in pinned CPU memory when offloading);
    backward recomputes the layer from x.

    Backward: x is brought back (copied to the device when offloaded), the layer is re-run with
    autograd on (`recomputing()` is True meanwhile: y's values are not used, only its graph),
    and `torch.autograd.backward(y, dy)` accumulates the parameter gradients and gives dx.
    """

    @staticmethod
    def forward(
        ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], offload: bool, hidden: torch.Tensor
    ) -> torch.Tensor:
        if offload:
            saved = torch.empty(hidden.shape, dtype=hidden.dtype, device="cpu", pin_memory=hidden.is_cuda)
            saved.copy_(hidden.detach(), non_blocking=True)
        else:
            saved = hidden.detach()
        ctx.run, ctx.saved_input, ctx.device = run, saved, hidden.device
        with torch.no_grad():
            return run(hidden)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        hidden = ctx.saved_input.to(ctx.device, non_blocking=True).detach().requires_grad_(True)
        ctx.saved_input = None
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
