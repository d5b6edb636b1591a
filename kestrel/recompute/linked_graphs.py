"""A linked call (`kestrel.recompute.linked.LinkedCall`) as a CUDA-graphed layer's extra inputs and
outputs (`kestrel.recompute.layer_graphs.GraphedLayer`).

A linked call's ties are tensors: its inputs (the grad-requiring positional arguments, Gemma 4's
per-layer input, then the shared mapping's tensors it finds, another layer's published K/V) and
its outputs (the tensors it writes into the mapping). In a graph each becomes a static buffer:

- inputs `links`: copied in before every replay (a fresh tensor is always copied: a replay never
  reads an earlier step's K/V); the graphs' calls get them in place of the arguments and in a
  fresh mapping of their own, so a replay never touches the run's mapping;
- outputs `wrote`: the first pass's graph copies each written tensor there, and the call
  returns clones of them (the graphs' pool is reused by the next replay);
- backward: with y = f(x, a, s) and w = g(x, a, s), one `torch.autograd.grad` of (y, *w) with
  incoming (dy, *dw) over (x, *inputs, *params); the written tensors' dw come in through static
  buffers `dw` (zeros where none arrives), the inputs' gradients go out through `dlinks`.

Slots are named by what a tie is (the argument's position, the mapping's key), so layers whose
ties have one shape share one buffer, as they share the hidden-state buffer. What a call wrote
on its eager first sighting (`WrittenLike`) decides its graphs' outputs; a capture that writes
anything else does not capture.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import MutableMapping
from typing import Any, Callable

import torch

from kestrel.recompute.graph_inputs import NotGraphable, StaticBuffers
from kestrel.recompute.linked import LinkedCall, Slot, put_slots, tensors_of


@dataclasses.dataclass(frozen=True)
class WrittenLike:
    """One tensor a linked call wrote into the shared mapping, as its eager first pass saw it."""

    slot: Slot
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    frame: Any = None  # a tuple value's container, its tensors None: what a replayed call writes into


@dataclasses.dataclass
class LinkBuffers:
    """One signature's static buffers for a linked call's ties (`GraphLinks.allocate`)."""

    written: list[WrittenLike]  # what the call writes, in `wrote` order
    links: list[torch.Tensor]  # the inputs, in `LinkedCall.inputs` order
    wrote: list[torch.Tensor]  # the first pass leaves the written tensors here
    dw: list[torch.Tensor]  # their incoming gradients, fed before the backward's replay
    dlinks: list[torch.Tensor]  # the backward leaves the inputs' gradients here
    got: list[bool] = dataclasses.field(default_factory=list)  # which inputs get a gradient (set on capture)


class GraphLinks:
    """The ties of one `LinkedCall` seen by a graphed layer: taken out of the call's arguments for
    its signature (`masked`, `key`), and put back as static buffers (`bind`)."""

    def __init__(self, linked: LinkedCall, kwargs: dict[str, Any]) -> None:
        self.linked = linked
        self.kwarg = next((k for k, v in kwargs.items() if v is linked.shared), None) if linked.shared is not None else None
        self.snapshot = dict(linked.shared.items()) if linked.shared is not None else {}  # before the first pass writes
        self.inputs = linked.inputs
        self.read = list(linked.read)
        self.wants = [t.requires_grad for t in self.inputs]

    def masked(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The call's arguments without its ties (the linked arguments are None, the mapping gone):
        what `graph_inputs.signature` describes and `substitute` fills."""
        args = tuple(None if i in self.linked.arg_slots else a for i, a in enumerate(args))
        return args, {k: v for k, v in kwargs.items() if k != self.kwarg}

    def key(self, device: torch.device) -> tuple:
        """The ties' part of a call's signature: which arguments are linked, which shared slots are
        read, and each input's shape, dtype and whether it requires grad. A layer that publishes
        K/V and one that reads them differ here (the slots read) and in their layer."""
        for t in self.inputs:
            if t.device != device:
                raise NotGraphable("a linked layer input is on another device")
        described = tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in self.inputs)
        return tuple(self.linked.arg_slots), tuple(self.read), described

    def input_slots(self) -> list[Any]:
        return [("link", "arg", i) for i in self.linked.arg_slots] + [("link", "shared", s) for s in self.read]

    def written_like(self) -> list[WrittenLike] | None:
        """What the eager first pass wrote (after `LinkedCall.first_pass`); None when it wrote part of
        a tuple value only (a replay could not rebuild the rest)."""
        if self.linked.shared is None:
            return []
        after, written = tensors_of(self.linked.shared), set(self.linked.written)
        keys = {key for key, _ in written}
        if any(slot[0] in keys and slot not in written for slot in after):
            return None
        out = []
        for key, index in self.linked.written:
            value, t = self.linked.shared[key], after[(key, index)]
            frame = None if index is None else type(value)(None if isinstance(v, torch.Tensor) else v for v in value)
            out.append(WrittenLike((key, index), tuple(t.shape), t.stride(), t.dtype, frame))
        return out

    def allocate(self, bufs: StaticBuffers, written: list[WrittenLike], device: torch.device) -> LinkBuffers:
        """Static buffers for the ties, laid out as the tensors they stand for (`get_strided`)."""
        def like(kind: str, slot: Any, t: torch.Tensor) -> torch.Tensor:
            return bufs.get_strided((kind, slot), tuple(t.shape), t.stride(), t.dtype, device)

        slots = self.input_slots()
        links = [like("in", s, t) for s, t in zip(slots, self.inputs)]
        dlinks = [like("din", s, t) for s, t in zip(slots, self.inputs)]
        wrote = [bufs.get_strided(("out", w.slot), w.shape, w.stride, w.dtype, device) for w in written]
        dw = [bufs.get_strided(("dout", w.slot), w.shape, w.stride, w.dtype, device) for w in written]
        return LinkBuffers(list(written), links, wrote, dw, dlinks)

    def feed(self, bufs: StaticBuffers, lb: LinkBuffers) -> None:
        """Copy the call's current inputs in (`StaticBuffers.feed` copies any tensor it did not just copy)."""
        for buf, t in zip(lb.links, self.inputs):
            bufs.feed(buf, t)

    def bind(
        self, call: Callable[..., torch.Tensor], args: tuple, kwargs: dict[str, Any], inputs: list[torch.Tensor],
        expect: list[WrittenLike],
    ) -> Callable[[torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]:
        """h -> (y, [the tensors written, in `expect` order]): the call with `inputs` in place of
        its ties (`args`, `kwargs`: the masked arguments, substituted) and a fresh mapping."""
        written = [w.slot for w in expect]
        n = len(self.linked.arg_slots)
        full = list(args)
        for i, t in zip(self.linked.arg_slots, inputs[:n]):
            full[i] = t
        read = dict(zip(self.read, inputs[n:]))

        def run(h: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
            if self.kwarg is None:
                return call(h, *full, **kwargs), []
            shared = _fresh(self.linked.shared, self.snapshot)
            put_slots(shared, read)
            y = call(h, *full, **{**kwargs, self.kwarg: shared})
            after = tensors_of(shared)
            now = [s for s, t in after.items() if read.get(s) is not t]
            if now != written:
                raise NotGraphable(f"a linked layer wrote {now} in its graph but {written} eagerly")
            return y, [after[s] for s in written]

        return run

    def publish_replayed(self, lb: LinkBuffers) -> list[torch.Tensor]:
        """After a first pass's replay: clones of the written tensors, which the checkpoint returns
        and `LinkedCall.publish` puts in the run's mapping; their tuple values are set up as an
        eager first pass leaves them (`WrittenLike.frame`), for `publish` to fill."""
        self.linked.written = [w.slot for w in lb.written]
        for w in lb.written:
            if w.frame is not None:
                self.linked.shared[w.slot[0]] = w.frame
        return [b.clone() for b in lb.wrote]


def _fresh(shared: MutableMapping, snapshot: dict) -> MutableMapping:
    """A mapping of `shared`'s type holding `snapshot`'s items."""
    out = copy.copy(shared)
    out.clear()
    out.update(snapshot)
    return out


def feed_dw(bufs: StaticBuffers, dw: list[torch.Tensor], grads: tuple[torch.Tensor | None, ...]) -> None:
    """The written tensors' incoming gradients into their static buffers; zeros where none arrives
    (a written tensor that no later layer read)."""
    if len(grads) != len(dw):
        raise ValueError(f"{len(grads)} gradients for {len(dw)} written tensors")
    for buf, grad in zip(dw, grads):
        if grad is None:
            buf.zero_()
            bufs.forget(buf)
        else:
            bufs.feed(buf, grad)


def grad_lists(
    h: torch.Tensor, y: torch.Tensor, dy: torch.Tensor, written: list[torch.Tensor], dw: list[torch.Tensor],
    leaves: list[torch.Tensor], params: list[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """`torch.autograd.grad`'s (outputs, inputs, grad_outputs) for one backward: outputs y and the
    written tensors autograd reaches, with dy and their dw; inputs h, the input leaves that
    require grad, then the parameters. `split_grads` maps its answer back."""
    outs = [(w, d) for w, d in zip(written, dw) if w.requires_grad]
    outputs = [y, *(w for w, _ in outs)]
    grad_outputs = [dy, *(d for _, d in outs)]
    return outputs, [h, *(t for t in leaves if t.requires_grad), *params], grad_outputs


def split_grads(
    grads: tuple[torch.Tensor | None, ...], wants: list[bool], n_params: int,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """(dh, the inputs' gradients in input order, None where one does not require grad, the
    parameters' gradients) from `torch.autograd.grad` over `grad_lists`'s inputs."""
    n = sum(wants)
    if len(grads) != 1 + n + n_params:
        raise ValueError(f"{len(grads)} gradients for 1 + {n} + {n_params} inputs")
    it = iter(grads[1 : 1 + n])
    return grads[0], [next(it) if w else None for w in wants], list(grads[1 + n :])
