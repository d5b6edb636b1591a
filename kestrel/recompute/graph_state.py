"""What one run's CUDA graphs of checkpointed decoder layers hold (`kestrel.recompute.layer_graphs`): per
device the static buffers, the pool and the capture stream; per layer and signature the two graphs and
the static buffers they address; and the protocol of a tensor kept between a layer's passes."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Protocol

import torch
from torch import nn

from kestrel.recompute.graph_inputs import StaticBuffers
from kestrel.recompute.linked_graphs import LinkBuffers, WrittenLike

KeptLike = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]  # a kept tensor's shape, strides and dtype


class GateKeeper(Protocol):
    """Where offloaded checkpointing keeps one layer call's MLP gate product E (M, I) between its
    first pass and its backward (`kestrel.recompute.checkpoint._KeptGate`), as a graphed layer uses it:
    E stays in a static device buffer that both graphs address, and the keeper moves that
    buffer's contents to host memory and back around the replays."""

    slot: int  # which of two static buffers: consecutive layers alternate

    @property
    def like(self) -> KeptLike | None:
        """E's shape, strides and dtype once an eager first pass has kept it (its static buffer is laid
        out so: `GraphBuffers.get_strided`)."""

    def bind(self, buf: torch.Tensor | None) -> None:
        """The MLP keeps E in `buf` and takes it from there (None: keeps nothing); the compute
        stream first waits until the buffer's last copy to or from the host is done."""

    def copy_out(self) -> None:
        """After the first pass: start copying the buffer to host memory."""

    def take(self) -> torch.Tensor | None:
        """Before the backward: E back in the buffer for the compute stream, or None."""

    def as_held(self) -> contextlib.AbstractContextManager[None]:
        """Meanwhile `take` returns the bound buffer as though a first pass had filled it: a backward graph
        captured before this call's first pass (`performance.backward_graph_capture: first_pass`) records
        the recompute that reads E, as one captured in the backward does."""


@dataclasses.dataclass
class _Device:
    """Per device: the static buffers, the graphs' memory pool and the capture stream."""

    buffers: StaticBuffers
    pool: Any
    stream: torch.cuda.Stream
    keeper: torch.cuda.CUDAGraph | None = None  # holds `pool` while the device's graphs come and go (`_pool_keeper`)


# --- Per-layer graphs ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Graphs:
    """One signature's graphs of one layer and the static buffers they read and write."""

    x: torch.Tensor  # layer input; the first pass leaves the output here
    leaves: list[torch.Tensor]  # the other tensor arguments
    forward: torch.cuda.CUDAGraph | None = None
    backward: torch.cuda.CUDAGraph | None = None
    grad: torch.Tensor | None = None  # incoming gradient; the backward leaves dX here
    params: list[tuple[nn.Parameter, torch.Tensor]] = dataclasses.field(default_factory=list)
    flats: list[torch.Tensor] = dataclasses.field(default_factory=list)  # gradient buffers, one per dtype
    gate: torch.Tensor | None = None  # the MLP gate product E between the passes (`GateKeeper`)
    kept: list[torch.Tensor] = dataclasses.field(default_factory=list)  # further kept tensors (attention out, lse)
    links: LinkBuffers | None = None  # a linked call's ties (`kestrel.recompute.linked_graphs`)
    failed: bool = False

    def buffers(self) -> list[torch.Tensor]:
        """Every static buffer these graphs address."""
        links = self.links
        tied = [*links.links, *links.wrote, *links.dw, *links.dlinks] if links is not None else []
        return [self.x, *self.leaves, *(t for t in (self.grad, self.gate) if t is not None), *self.kept, *self.flats,
                *tied]


class _LayerState:
    def __init__(self) -> None:
        self.seen: dict[Any, int] = {}
        self.gate_like: dict[Any, KeptLike] = {}  # E kept by a first sighting
        self.kept_like: dict[Any, list[KeptLike]] = {}  # the other kept tensors
        self.wrote: dict[Any, list[WrittenLike]] = {}  # what a linked call's first sighting wrote
        self.graphs: collections.OrderedDict[Any, _Graphs] = collections.OrderedDict()
        self.captures = 0
        self.eager_backwards = 0  # backwards run eagerly after a graphed first pass
        self.off = False
