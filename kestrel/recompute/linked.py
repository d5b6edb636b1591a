"""Checkpointing a decoder layer that is tied to other layers by more than its hidden states.

A checkpointed layer runs its first pass under no_grad and keeps only its input, so any other
tensor it reads or writes would leave the autograd graph: its gradient lost, or (a tensor built
with grad outside the layer and read by every layer) back-propagated once per recompute, which
fails on the second. Gemma 4 has both: a per-layer input (a positional argument computed once
from the embeddings) and K/V that the last non-shared layer of each attention type writes into a
mapping (`FamilySpec.layer_shared_state`) and every later layer of that type reads.

`LinkedCall` makes those ties explicit inputs and outputs of the layer's `LayerCheckpoint`:
- inputs: the positional tensors that require grad, and the tensors of the shared mapping present
  when the layer runs (another layer's published outputs);
- outputs, beside the hidden states: the tensors the layer wrote into the mapping, which are
  published back into it so that later layers read tensors autograd can reach.

Backward: with y = f(x, a, s) and the written tensors w = g(x, a, s), the recompute runs the layer
with x, a and s as fresh leaves and back-propagates (dy, dw) through (y, w); the leaves' gradients
are dx, da and ds, which autograd routes to whatever produced a and s (for s, the writing layer's
checkpoint, whose backward runs later and receives ds as its dw).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Callable

import torch

Slot = tuple[Any, int | None]  # (mapping key, index in its tuple value or None for a bare tensor)


def tensors_of(mapping: MutableMapping) -> dict[Slot, torch.Tensor]:
    """The mapping's tensors by slot: a value that is a tensor, or a tuple / list of them."""
    out: dict[Slot, torch.Tensor] = {}
    for key, value in mapping.items():
        if isinstance(value, torch.Tensor):
            out[(key, None)] = value
        elif isinstance(value, (tuple, list)):
            out.update({(key, i): t for i, t in enumerate(value) if isinstance(t, torch.Tensor)})
    return out


def put_slots(mapping: MutableMapping, values: dict[Slot, torch.Tensor]) -> None:
    """Write tensors back into their slots, rebuilding tuple values."""
    for (key, index), tensor in values.items():
        if index is None:
            mapping[key] = tensor
        else:
            parts = list(mapping[key])
            parts[index] = tensor
            mapping[key] = type(mapping[key])(parts)


class LinkedCall:
    """One checkpointed call of a layer with ties beyond its hidden states (see the module)."""

    def __init__(self, run: Callable[..., torch.Tensor], args: tuple, shared: MutableMapping | None) -> None:
        self.run, self.args, self.shared = run, args, shared
        self.arg_slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        self.read: dict[Slot, torch.Tensor] = tensors_of(shared) if shared is not None else {}
        self.written: list[Slot] = []

    @staticmethod
    def of(run: Callable[..., torch.Tensor], args: tuple, shared_kwarg: str | None) -> LinkedCall | None:
        """The call's links, or None when it has none (the usual decoder layer)."""
        keywords = getattr(run, "keywords", None) or {}
        shared = keywords.get(shared_kwarg) if shared_kwarg else None
        call = LinkedCall(run, args, shared if isinstance(shared, MutableMapping) else None)
        return call if call.shared is not None or call.arg_slots else None

    @property
    def inputs(self) -> list[torch.Tensor]:
        """The tensors besides the hidden states whose gradient the checkpoint returns."""
        return [self.args[i] for i in self.arg_slots] + list(self.read.values())

    def first_pass(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(y, *written): the layer's output and the tensors it wrote into the shared mapping."""
        y = self.run(hidden, *self.args)
        if self.shared is None:
            return (y,)
        after = tensors_of(self.shared)
        self.written = [slot for slot, t in after.items() if self.read.get(slot) is not t]
        return (y, *(after[slot] for slot in self.written))

    def publish(self, written: tuple[torch.Tensor, ...]) -> None:
        """Put the checkpoint's outputs (autograd-reachable) in place of what the first pass wrote."""
        if self.shared is not None and written:
            put_slots(self.shared, dict(zip(self.written, written)))

    def backward(
        self, recompute: Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor],
        hidden: torch.Tensor, grad_out: torch.Tensor, grad_written: tuple[torch.Tensor | None, ...],
    ) -> list[torch.Tensor | None]:
        """Recompute with fresh leaves for `hidden` (already one) and every input, back-propagate
        (grad_out, grad_written) and return the inputs' gradients in `inputs` order."""
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in self.inputs]
        args = list(self.args)
        for i, leaf in zip(self.arg_slots, leaves):
            args[i] = leaf
        kept = dict(self.shared.items()) if self.shared is not None else {}
        try:
            if self.shared is not None:
                put_slots(self.shared, dict(zip(self.read, leaves[len(self.arg_slots):])))
            y = recompute(lambda h: self.run(h, *args), hidden)
            rewritten = tensors_of(self.shared) if self.shared is not None else {}
            outs, grads = [y], [grad_out]
            for slot, grad in zip(self.written, grad_written):
                if grad is not None and rewritten[slot].requires_grad:
                    outs.append(rewritten[slot])
                    grads.append(grad)
            torch.autograd.backward(outs, grads)
        finally:
            if self.shared is not None:
                self.shared.clear()
                self.shared.update(kept)
        return [leaf.grad for leaf in leaves]
