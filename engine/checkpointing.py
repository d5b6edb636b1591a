"""Gradient checkpointing: off, standard (recompute each decoder layer), or offload.

Offload keeps only each decoder layer's input, and keeps it in pinned CPU memory: the copy out is
queued on the compute stream right after the layer runs (it overlaps the next layers), and the
copy back is queued at the start of that layer's backward. GPU memory for activations then no
longer grows with the number of layers, which is what lets long contexts fit.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


class OffloadedCheckpoint(torch.autograd.Function):
    """y = layer(x), saving x in CPU memory only; backward recomputes the layer from x.

    Backward: x is copied back to the device, the layer is re-run with autograd on, and
    `torch.autograd.backward(y, dy)` accumulates the parameter gradients and gives dx.
    """

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        saved = torch.empty(hidden.shape, dtype=hidden.dtype, device="cpu", pin_memory=hidden.is_cuda)
        saved.copy_(hidden.detach(), non_blocking=True)
        ctx.run, ctx.saved_cpu, ctx.device = run, saved, hidden.device
        with torch.no_grad():
            return run(hidden)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, torch.Tensor]:
        hidden = ctx.saved_cpu.to(ctx.device, non_blocking=True).requires_grad_(True)
        with torch.enable_grad():
            out = ctx.run(hidden)
        torch.autograd.backward(out, grad_out)
        return None, hidden.grad


def offloaded_checkpoint(run: Callable[..., torch.Tensor], hidden: torch.Tensor, *args: Any) -> torch.Tensor:
    """The `_gradient_checkpointing_func` Hugging Face's decoder layers call (hidden first)."""
    if args:
        return OffloadedCheckpoint.apply(lambda h: run(h, *args), hidden)
    return OffloadedCheckpoint.apply(run, hidden)


def set_gradient_checkpointing(model: nn.Module, mode: str) -> None:
    """Turn checkpointing `off`, `standard` (non-reentrant recompute) or `offload` on `model`."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if mode == "off":
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "offload":
        # The offloaded function is reentrant: its input must require grad for its backward to run
        # even when the embeddings are frozen (LoRA).
        model.enable_input_require_grads()
        for layer in model.modules():
            if isinstance(layer, GradientCheckpointingLayer):
                layer._gradient_checkpointing_func = offloaded_checkpoint
