"""No-grad forwards of a checkpointed model through its layers' CUDA graphs: the reference pass of
DPO and KTO (the base with the adapter disabled, scored on the same rows as the policy's forward).

Why: a reference pass is as long as the policy's first pass, and run eagerly each of its layers is
dozens of launches behind Python, so on the rows a run has decided to graph the GPU waits for the
host there too (bench/RESULTS.md, DPO, session 20: the idle gaps of a step were mostly in its
reference pass). Replayed, a layer's reference forward is one launch.

How: Hugging Face's decoder layers call their `_gradient_checkpointing_func` (the run's
`Recompute`) only in training mode. `no_grad_forwards` marks the decoder layer modules alone as
training, so their calls reach `Recompute`; every submodule, where dropout and the attention's
mode live, stays in eval mode, and no decoder layer of the supported families reads its own flag.
`Recompute` then hands each no-grad call to `call`: at the first layer it asks the run's
`GraphChooser` whether this layout (the same key as a training forward of these rows) is decided
graphed; it times nothing, so a layout still being timed runs eagerly. A reference pass otherwise
runs its real columns alone, a width no training forward has, so once the run has decided to graph
some layout it takes the training forward's rounded width instead (`replays_training_shapes`):
the padding columns (at most an eighth of the row, `kestrel.data.collate.bucket_width`) then buy
replayed layers; while the chooser is still timing, or where every layout runs eagerly, the
reference keeps its real columns. A graphed call replays a
first-pass graph of its own signature (the adapter switch is part of it: `layer_graphs.layer_state`),
captured on its second sighting once the layer holds a backward graph.

    with no_grad_forwards(recompute):      # inside as_reference's eval mode and no_grad
        ref = answer_logprobs(model, rows)
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from kestrel.recompute import layer_graphs
from kestrel.recompute.linked import LinkedCall

if TYPE_CHECKING:
    from kestrel.recompute.checkpoint import Recompute


@contextlib.contextmanager
def no_grad_forwards(recompute: Recompute | None) -> Iterator[None]:
    """Route the checkpointed decoder layers' calls through `recompute` while the model is in eval
    mode (see the module); restores each layer's flag after. With no `recompute` (checkpointing
    off), nothing changes."""
    if recompute is None:
        yield
        return
    layers = [layer for layer in recompute.layers() if not layer.training]
    for layer in layers:
        layer.training = True  # the module alone: not `.train()`, which would reach its submodules
    recompute.no_grad_active = True
    try:
        yield
    finally:
        recompute.no_grad_active = False
        for layer in layers:
            layer.training = False


def replays_training_shapes(model: nn.Module) -> bool:
    """Whether a no-grad forward of `model` should take the training forward's shapes: it runs
    under `no_grad_forwards` of a run that has decided to graph some layout."""
    from kestrel.recompute.checkpoint import recompute_of  # checkpoint.py imports this module

    recompute = recompute_of(model)
    return recompute is not None and recompute.no_grad_active and recompute.chooser.graphs_kept()


def call(recompute: Recompute, run: Callable[..., torch.Tensor], hidden: torch.Tensor, args: tuple) -> torch.Tensor:
    """One decoder layer's call in a no-grad forward under `no_grad_forwards`: its first-pass graph
    where the forward's layout is decided graphed, else the layer as it is."""
    usable = layer_graphs.graphable(run, hidden, training=False)
    if recompute.starts_forward(run):
        key = layer_graphs.call_key(run, hidden, args) if usable else None
        recompute.no_grad_graphed = key is not None and recompute.chooser.decided_graphed(key)
    if not (recompute.no_grad_graphed and usable) or _linked(recompute, run, args):
        return run(hidden, *args)
    recompute.holds_graphs = True
    return layer_graphs.GraphedLayer(run, hidden, args, recompute.graphs)(hidden, alone=True)


def _linked(recompute: Recompute, run: Any, args: tuple) -> bool:
    """A layer tied to others beyond its hidden states (`LinkedCall`) is never graphed."""
    return recompute.shared_state is not None and LinkedCall.of(run, args, recompute.shared_state) is not None
