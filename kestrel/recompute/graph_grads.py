"""A graphed decoder layer's parameter gradients (`kestrel.recompute.layer_graphs`): the backward
graph writes them into one static flat buffer per dtype; after each replay one clone of each
buffer gives every parameter a view of it as `.grad` (or is added into the one accumulating)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kestrel.recompute.graph_inputs import StaticBuffers

if TYPE_CHECKING:
    from kestrel.recompute.graph_state import _Graphs


def flat_slots(g: _Graphs, bufs: StaticBuffers, params: list[nn.Parameter]) -> list[tuple[nn.Parameter, int, int]]:
    """(parameter, flat buffer index, offset) for each parameter; sets g.flats, one static
    gradient buffer per dtype (shared by the layers with the same parameter sizes)."""
    totals: dict[torch.dtype, int] = {}
    slots = []
    for p in params:
        start = totals.get(p.dtype, 0)
        totals[p.dtype] = start + p.numel()
        slots.append((p, p.dtype, start))
    dtypes = list(totals)
    device = params[0].device if params else g.x.device
    g.flats = [bufs.get(("grads", dt), (totals[dt],), dt, device) for dt in dtypes]
    return [(p, dtypes.index(dt), start) for p, dt, start in slots]


def set_grads(g: _Graphs) -> None:
    """Give each parameter its gradient from the replayed graph: one clone per flat buffer, a
    view of it as `.grad`, or added into the gradient being accumulated."""
    fresh = [f.clone() for f in g.flats]
    into, add = [], []
    for p, i, start in g.params:
        view = fresh[i][start : start + p.numel()].view(p.shape)
        if p.grad is None:
            p.grad = view
        else:
            into.append(p.grad)
            add.append(view)
    if into:
        torch._foreach_add_(into, add)
