"""Gradient checkpointing: off, standard (recompute each decoder layer), or offload.

Both modes use one reentrant autograd Function per decoder layer (`LayerCheckpoint`): the layer
runs under no_grad and only its input is kept. torch's non-reentrant checkpoint is not used: it
installs saved-tensor hooks on every op of the layer, host work that left the GPU idle for much
of a QLoRA step (bench/RESULTS.md, QLoRA SFT, the first run).

Standard keeps the layer input on the GPU. Offload keeps it in pinned CPU memory (`_HostCopy`):
copied out on a side stream while the next layers compute, copied back when the layer above
begins its backward, so activation memory no longer grows with the number of layers, which is
what lets long contexts fit. Offload also pages out each layer's MLP gate product E (`_KeptGate`,
the `kestrel.kernels.lora.mlp.GateStore` the layer's LoRA MLP gets), and the recompute takes E
back instead of forming its largest product: this spends the host link, which moves E in less
time than the layer's first pass takes, not GPU memory (bench/RESULTS.md, QLoRA "Session 11").
`KESTREL_OFFLOAD_GATE` is the share of layers that do it; MLPs that defer to their backward
(long rows) never do.

On CUDA, when the run's `GraphChooser` finds it faster for the forward's batch layout, each
layer's first pass and its recompute-with-backward replay as CUDA graphs
(`kestrel.recompute.layer_graphs`): `Recompute` hands `LayerCheckpoint` a `GraphedLayer` instead
of the plain call (or of the `LinkedCall` of a layer with ties beyond its hidden states). The
pinned host buffers and the side stream come from `kestrel.recompute.host_memory`.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable

from kestrel import env
import torch
from torch import nn

from kestrel.model.registry import family_for
from kestrel.recompute import layer_graphs, no_grad
from kestrel.recompute.gate_share import gate_share, paged_gate_layers, pages_gate_out
from kestrel.recompute.graph_choice import CudaClock, Decision, GraphChooser, GraphMode
from kestrel.recompute.host_memory import HostMemoryError, host_buffer, side_stream
from kestrel.recompute.linked import LinkedCall
from kestrel.recompute.mlp_deferral import defer_mode, MLPDeferral

log = logging.getLogger("kestrel")


@dataclasses.dataclass
class OffloadState:
    """One run's bookkeeping of offloaded tensors (`_HostTensor`)."""

    # Tensors whose copy out may still be running, each with the event that marks its end.
    reading: list[tuple[torch.Tensor, Any]] = dataclasses.field(default_factory=list)
    last: weakref.ref | None = None  # the layer-input copy made most recently (`_HostCopy`)
    side_use: dict[int, Any] = dataclasses.field(default_factory=dict)  # static buffer address -> its last copy's end
    warned: bool = False  # "not paging MLP activations out" said once

    def release_read(self) -> None:
        """Let go of the tensors copied out so far, once the compute stream has waited for their
        copies (enqueued now: by the time the stream gets there they have finished)."""
        while self.reading:
            t, done = self.reading.pop()
            torch.cuda.current_stream(t.device).wait_event(done)


class _HostTensor:
    """One tensor kept in pinned host memory from a layer's first pass to its backward
    (offloaded checkpointing): the base of a layer input's `_HostCopy` and a gate product's
    `_KeptGate`.

    On CUDA both copies run on a side stream, so neither holds up the compute stream, and no
    block changes streams behind the allocator's back:
    - The copy out reads the tensor on the side stream. Rather than `record_stream` (a block
      freed that way waits for everything the side stream has queued by then, so layers would
      take fresh blocks and reserved memory would grow; bench/RESULTS.md, QLoRA "Session 11"),
      the tensor is held until
      the next copy out (or the first copy back) makes the compute stream wait for it, by which
      time the copy is long done; its block is then freed in the compute stream's order.
    - The copy back lands in a block of the compute stream's own pool (the side stream first
      waits for the work queued on the compute stream so far, which may have used that block),
      and the compute stream waits for the copy before it takes the tensor, or, should it never
      be taken, before the block is freed.
    On CUDA the host memory is an exact-size pinned buffer from the device's pool
    (`_PinnedPool`), given back once the copy back is enqueued, or when the owner is collected
    without a backward.
    """

    def __init__(self, state: OffloadState) -> None:
        self.state = state
        self.host: torch.Tensor | None = None
        self.give_back: weakref.finalize | None = None
        self.fetched: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None
        self.unwaited: weakref.finalize | None = None

    def _keep(self, t: torch.Tensor) -> None:
        """Copy t out, holding t until the compute stream has waited for the copy (raises
        HostMemoryError when host memory cannot be page-locked)."""
        done = self._copy_out(t)
        if done is not None:
            self.state.reading.append((t, done))

    def _copy_out(self, t: torch.Tensor) -> torch.cuda.Event | None:
        """Start copying t into a host buffer; on CUDA, the event that marks the copy's end."""
        self.host, self.give_back = host_buffer(self, t)
        self.device = t.device
        if not t.is_cuda:
            self.host.copy_(t.detach())
            return None
        self.state.release_read()
        current, side = torch.cuda.current_stream(t.device), side_stream(t.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.host.copy_(t.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        return done

    def prefetch(self) -> None:
        """Start the copy back to the device (CUDA), once."""
        if self.fetched is not None or self.host is None or self.device.type != "cuda":
            return
        self.state.release_read()
        current, side = torch.cuda.current_stream(self.device), side_stream(self.device)
        out = self._landing()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out.copy_(self.host, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(side)
        self.fetched = out
        self._guard(current)

    def _landing(self) -> torch.Tensor:
        """Where the copy back lands: a new block of the compute stream's pool."""
        return torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)

    def _guard(self, current: torch.cuda.Stream) -> None:
        """Should the copy back never be taken (a step abandoned mid-backward), the compute
        stream waits for it before its block goes back to the pool (weakref callbacks run before
        attributes are freed)."""
        self.unwaited = weakref.finalize(self, current.wait_event, self.ready)
        self.unwaited.atexit = False

    def take(self) -> torch.Tensor | None:
        """The tensor back on its device for the compute stream (None when nothing was kept);
        its host buffer goes back to the pool once the copy back is enqueued."""
        if self.host is None:
            return None
        if self.device.type != "cuda":
            out = self.host.to(self.device, copy=self.give_back is not None)  # a pooled buffer is reused
        else:
            self.prefetch()
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            if self.unwaited is not None:
                self.unwaited.detach()
            out = self.fetched
        self.host = self.fetched = None
        if self.give_back is not None:
            self.give_back()
        return out


class _HostCopy(_HostTensor):
    """One layer input kept in pinned host memory (offloaded checkpointing), with its layer's
    kept gate product when there is one.

    The copy out starts once the input is written and overlaps the next layers; the copy back of
    the layer below (input and gate product) is started when this layer's backward begins, so it
    overlaps this layer's recompute and backward. Each copy knows the one made just before it in
    the forward (weakly: a finished step's copies are gone once their graph is).
    """

    def __init__(self, state: OffloadState, hidden: torch.Tensor) -> None:
        super().__init__(state)
        self.below, state.last = state.last, weakref.ref(self)
        below = self.below() if self.below is not None else None
        self.depth: int = 0 if below is None else below.depth + 1  # layers below it in this forward
        self.gate: _KeptGate | None = None  # this layer's MLP gate product, when paged out too
        self._keep(hidden)

    def prefetch(self) -> None:
        """Start the copy back to the device (CUDA), once; and the kept gate product's."""
        if self.gate is not None:
            self.gate.prefetch()
        super().prefetch()

    def take(self) -> torch.Tensor:
        """The input back on its device, for the compute stream; then start the layer below's."""
        out = super().take()
        below = self.below() if self.below is not None else None
        if below is not None:
            below.prefetch()
        return out


class _KeptGate(_HostTensor):
    """A layer MLP's gate product E (M, I) kept in pinned host memory from the layer's first pass
    to its recompute (`kestrel.kernels.lora.mlp.GateStore`), riding along with the layer input's `_HostCopy`.
    When host memory cannot be page-locked, E is not kept (the recompute computes it), with a
    warning.

    In a CUDA-graphed layer (`layer_graphs.GraphedLayer`, the `layer_graphs.GateKeeper` it
    uses) E lives on the device between the passes in a static buffer the layer's two graphs
    write and read (`bind`), one of two: consecutive layers alternate (`slot`), so one layer's E
    is copied out (`copy_out`, after its first pass) while the next layer computes, and is copied
    back into the same buffer for its backward (`take`). Each buffer's last side-stream copy is
    remembered (`OffloadState.side_use`); the compute stream waits for it before a first pass writes the
    buffer again (`bind`)."""

    def __init__(self, state: OffloadState, slot: int = 0) -> None:
        super().__init__(state)
        self.slot = slot
        self.bound = False  # E lives in `static` (a graphed layer): `bind`
        self.static: torch.Tensor | None = None
        self.holds = False  # E was copied out of `static`

    @property
    def like(self) -> tuple[tuple[int, ...], torch.dtype] | None:
        """E's shape and dtype once a first pass has kept it (None before, or if it did not)."""
        return None if self.host is None else (tuple(self.host.shape), self.host.dtype)

    def bind(self, buf: torch.Tensor | None) -> None:
        """From now on E lives in `buf` on the device: `keep` copies it there (work on the current
        stream, so part of a graph being captured) and `take` returns it. None: keep nothing. A
        first pass is about to overwrite `buf`: the compute stream first waits for its last copy
        out (or in), which ended long ago (a layer's work back)."""
        self.bound, self.static = True, buf
        done = None if buf is None else self.state.side_use.get(buf.data_ptr())
        if done is not None:
            torch.cuda.current_stream(buf.device).wait_event(done)

    def target(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The bound buffer, when it fits: the MLP writes E there itself (no copy)."""
        fits = self.static is not None and tuple(self.static.shape) == tuple(shape) and self.static.dtype == dtype
        return self.static if fits else None

    def keep(self, e: torch.Tensor) -> None:
        if self.bound:
            if self.static is not None and e is not self.static:
                self.static.copy_(e)
            return
        if self.host is not None:
            raise RuntimeError("a layer's gate product was kept twice in one forward")
        try:
            self._keep(e)
        except HostMemoryError as err:
            self._warn(err)

    def copy_out(self) -> None:
        """After a first pass has filled the bound buffer: start copying it to host memory."""
        if self.static is None:
            return
        try:
            done = self._copy_out(self.static)
        except HostMemoryError as err:
            self._warn(err)
            return
        self.holds = True
        if done is not None:
            self.state.side_use[self.static.data_ptr()] = done

    def take(self) -> torch.Tensor | None:
        if not self.bound:
            return super().take()
        if self.host is not None:  # first call: copy E back into the bound buffer, for the compute stream
            got = super().take()
            if got is not self.static:  # on the CPU the copy is a new tensor
                self.static.copy_(got)
        return self.static if self.holds else None

    def _landing(self) -> torch.Tensor:
        return self.static if self.bound else super()._landing()

    def _guard(self, current: torch.cuda.Stream) -> None:
        if self.bound:  # a static buffer is never freed: its next first pass waits for the copy
            self.state.side_use[self.static.data_ptr()] = self.ready
        else:
            super()._guard(current)

    def _warn(self, err: HostMemoryError) -> None:
        if not self.state.warned:
            log.warning("not paging MLP activations out (%s); recomputing them instead", err)
            self.state.warned = True


class LayerCheckpoint(torch.autograd.Function):
    """y = layer(x), keeping only x (on the GPU, or in pinned CPU memory when offloading,
    `_HostCopy`); backward recomputes the layer from x.

    Backward: x is brought back (copied to the device when offloaded), the layer is re-run with
    autograd on (`owner.recomputing` is True meanwhile: y's values are not used, only its
    graph), and `torch.autograd.backward(y, dy)` accumulates the parameter gradients and gives dx.
    `owner.gate` is the layer's gate-product store during both passes (offload).
    """

    @staticmethod
    def forward(
        ctx: Any, run: Callable[[torch.Tensor], torch.Tensor] | LinkedCall, owner: Recompute, hidden: torch.Tensor,
        *links: torch.Tensor,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        ctx.run, ctx.owner = run, owner
        ctx.saved_input = _HostCopy(owner.offloaded, hidden) if owner.offload else hidden.detach()
        ctx.gate = None
        if owner.offload and owner.pages_gate_out(ctx.saved_input.depth):
            ctx.gate = ctx.saved_input.gate = _KeptGate(owner.offloaded, slot=ctx.saved_input.depth % 2)
        owner.gate = ctx.gate
        try:
            with torch.no_grad():
                if isinstance(run, layer_graphs.GraphedLayer):
                    return run(hidden, ctx.gate)
                if isinstance(run, LinkedCall):  # `links` are its inputs: (y, *what it wrote)
                    return run.first_pass(hidden)
                return run(hidden)
        finally:
            owner.gate = None

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *grad_written: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, ctx.saved_input = ctx.saved_input, None
        owner, run = ctx.owner, ctx.run
        owner.gate = ctx.gate
        try:
            if isinstance(run, layer_graphs.GraphedLayer):  # hands the input over: not kept here
                grads, hidden = run.backward(_taken(saved), grad_out, owner.recompute, grad_written)
                if grads is not None:
                    return None, None, *grads
                run = run.links.linked if run.links is not None else run  # eagerly, as it would be ungraphed
            else:
                hidden = _taken(saved)
            hidden = hidden.detach().requires_grad_(True)
            if isinstance(run, LinkedCall):
                link_grads = run.backward(owner.recompute, hidden, grad_out, grad_written)
                return None, None, hidden.grad, *link_grads
            torch.autograd.backward(owner.recompute(run, hidden), grad_out)
        finally:
            # The context is done: drop the call. A linked call holds the shared mapping, which
            # holds this checkpoint's outputs, whose grad_fn holds this context: a cycle through
            # autograd's C++ graph, which Python's collector cannot see, so it was never freed.
            owner.gate = ctx.gate = ctx.run = ctx.owner = None
        return None, None, hidden.grad


def _taken(saved: _HostCopy | torch.Tensor) -> torch.Tensor:
    """A checkpoint's saved layer input, back on its device."""
    return saved.take() if isinstance(saved, _HostCopy) else saved


class Recompute:
    """One run's checkpointing: the function Hugging Face's decoder layers call
    (`_gradient_checkpointing_func`, hidden states first) and the run's CUDA-graph choice.

    At the first layer of each training forward on CUDA it asks `chooser` whether this forward's
    layers run as CUDA graphs (`kestrel.recompute.graph_choice`, keyed by that layer's call signature), and
    every layer of the forward follows the answer. Graphs are dropped once no layout is left that
    runs them. A call with grad disabled (a no-grad pass of a model in training mode: KTO's KL
    rows) runs the layer as it is: nothing will be back-propagated; within `no_grad_forwards` (a
    reference pass) it may replay a first-pass graph (`kestrel.recompute.no_grad`).
    """

    def __init__(
        self, offload: bool, first_layer: nn.Module | None, chooser: GraphChooser, gate_share: float = 1.0,
        shared_state: str | None = None, deferral: MLPDeferral | None = None,
    ) -> None:
        self.offload, self.chooser, self.gate_share = offload, chooser, gate_share
        self.deferral = deferral if deferral is not None else MLPDeferral()  # whether recomputed MLPs defer
        self.shared_state = shared_state  # the layers' keyword holding tensors shared between them (`LinkedCall`)
        self.first = weakref.ref(first_layer) if first_layer is not None else None
        self._layers: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the decoder layers calling it
        self.graphed = False  # this forward's choice
        self.no_grad_active, self.no_grad_graphed = False, False  # inside `no_grad_forwards`; its forward's choice
        self.graphs = layer_graphs.GraphRegistry()
        self.holds_graphs = False
        self.offloaded = OffloadState()
        # While a layer's checkpoint runs: True in its recompute for backward (its output's values
        # are thrown away, only its graph is used, so the decoder layer tells its MLP to skip the
        # down product and skips the last residual sum); its gate-product store (offload).
        self.recomputing = False
        self.gate: _KeptGate | None = None

    def pages_gate_out(self, depth: int) -> bool:
        """Whether an offloaded layer (`depth` layers below it) pages its MLP's gate product out
        too: a `gate_share` of the layers, spread evenly."""
        return pages_gate_out(depth, self.gate_share)

    def recompute(self, run: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """run(hidden) with autograd on, as a checkpoint's recompute (`recomputing` meanwhile)."""
        self.recomputing = True
        try:
            with torch.enable_grad():
                return run(hidden)
        finally:
            self.recomputing = False

    def __call__(self, run: Callable[..., torch.Tensor], hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():  # nothing will be back-propagated: nothing to keep, no training forward to time
            return no_grad.call(self, run, hidden, args) if self.no_grad_active else run(hidden, *args)
        linked = LinkedCall.of(run, args, self.shared_state)
        if self.starts_forward(run) and layer_graphs.graphable(run, hidden):
            key = layer_graphs.call_key(run, hidden, args, linked)
            tokens = hidden.numel() // max(hidden.shape[-1], 1)
            self.graphed = key is not None and self.chooser.begin(key, tokens, f"{tuple(hidden.shape[:-1])} tokens")
            if self.holds_graphs and not self.chooser.any_graphed():
                self.release()  # every layout runs eagerly: give the graphs' memory back
            self.holds_graphs |= self.graphed
        wrapped = layer_graphs.wrap(run, hidden, args, self.graphs if self.graphed else None, linked)
        if linked is not None:  # `LinkedCall` or a `GraphedLayer` of it: its ties are the checkpoint's too
            y, *written = LayerCheckpoint.apply(wrapped, self, hidden, *linked.inputs)
            linked.publish(tuple(written))
            return y
        return LayerCheckpoint.apply(wrapped, self, hidden)

    def release(self) -> None:
        """Drop the run's CUDA graphs and give their memory back."""
        self.graphs.release()
        self.holds_graphs = False
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def starts_forward(self, run: Callable[..., torch.Tensor]) -> bool:
        """Whether `run` is the call of the forward's first decoder layer."""
        layer = getattr(getattr(run, "func", None), "__self__", None)
        return self.first is not None and layer is self.first()

    def layers(self) -> list[nn.Module]:
        return list(self._layers)  # the decoder layers checkpointed through this run's recompute


def graph_mode(configured: GraphMode) -> GraphMode:
    """The run's CUDA-graph mode: KESTREL_CUDA_GRAPHS (1 | 0 | auto, a debugging override)
    wins over the configured one."""
    forced = env.choice("KESTREL_CUDA_GRAPHS", {"1": "on", "on": "on", "0": "off", "off": "off", "auto": "auto"})
    return configured if forced is None else forced  # type: ignore[return-value]


def set_gradient_checkpointing(
    model: nn.Module, mode: str, cuda_graphs: GraphMode = "auto", on_decision: Callable[[Decision], None] | None = None,
    offload_gate: float = 1.0, deferral: MLPDeferral | None = None,
) -> Recompute | None:
    """Turn checkpointing `off`, `standard` (recompute each layer) or `offload` on `model`; returns
    the run's `Recompute` (None when off). `cuda_graphs` and `on_decision`: `GraphChooser`'s;
    `offload_gate`: the share of offloaded layers that page their MLP gate product out; `deferral`:
    whether a recomputed MLP defers to its backward (`kestrel.recompute.mlp_deferral`; default `memory`, or KESTREL_DEFER_MLP).

    Both modes checkpoint with our reentrant `LayerCheckpoint`. Hugging Face's
    `gradient_checkpointing_enable` is called with use_reentrant=False only to set HF's flags
    (each decoder layer then calls its `_gradient_checkpointing_func`); that function is then
    replaced by the run's `Recompute`, so no decoder layer runs torch's checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    previous = recompute_of(model)
    if previous is not None:
        previous.release()
    if mode == "off":
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        return None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Our function is reentrant: its input must require grad for its backward to run even when
    # the embeddings are frozen (LoRA).
    model.enable_input_require_grads()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    chooser = GraphChooser(graph_mode(cuda_graphs), CudaClock() if torch.cuda.is_available() else None,
                           on_decision=on_decision)
    spec = family_for(model.config)
    recompute = Recompute(mode == "offload", _first_decoder_layer(model, layers), chooser, gate_share(offload_gate),
                          shared_state=spec.layer_shared_state if spec is not None else None,
                          deferral=deferral if deferral is not None else MLPDeferral(defer_mode("memory")))
    if recompute.offload:  # the gate products whole rows would page out (`kestrel.recompute.mlp_deferral`)
        recompute.deferral.paged_layers = paged_gate_layers(len(layers), recompute.gate_share)
    for layer in layers:
        layer._gradient_checkpointing_func = recompute
        recompute._layers.add(layer)
    return recompute


def _first_decoder_layer(model: nn.Module, layers: list[nn.Module]) -> nn.Module | None:
    """The layer a training forward starts with: the language model's first decoder layer (an
    image-text model's vision encoder layers come first in module order, and text never runs them)."""
    spec = family_for(model.config)
    ours = [m for m in layers if spec is not None and type(m).__name__ == spec.decoder_layer_class]
    return (ours or layers or [None])[0]


def scope_of(layer: nn.Module) -> Recompute | None:
    """The run's `Recompute` a checkpointed decoder layer is called through, or None."""
    func = layer.__dict__.get("_gradient_checkpointing_func")
    return func if isinstance(func, Recompute) and layer.gradient_checkpointing else None


def recompute_of(model: nn.Module) -> Recompute | None:
    """The run's `Recompute` that `model`'s decoder layers are checkpointed through, or None."""
    for module in model.modules():
        func = module.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, Recompute):
            return func
    return None
