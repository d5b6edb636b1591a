"""CUDA graphs for checkpointed decoder layers: a layer's first pass, and its recompute together
with its backward, each replayed as one launch.

Why: a layer's first pass is a few dozen launches and its recompute and backward over a hundred,
each behind Python (the LoRA Functions, the autograd engine, Triton's launcher). Where the host
sets the pace (small models, short rows) graphs pay many times over; where the GPU does, they
change little (bench/RESULTS.md, QLoRA "Session 8", "Session 12" and the matrix's "Session 15").
`kestrel.recompute.graph_choice` times both ways per batch layout; `wrap` is told the answer.
A checkpointed layer is a pure function of its input, a few tensors made once per forward
(rotary tables, position ids, attention metadata) and its weights, which stay at fixed addresses
(NF4 weights, the dequantization workspace, adapters updated in place), so it replays exactly.

How (`GraphedLayer`): a call's signature (`kestrel.recompute.graph_inputs`: shapes, dtypes and
values, plus the layer's state) runs eagerly on its first sighting, which compiles kernels and
sizes workspaces. With `capture_ahead` (the run's default, `performance.backward_graph_capture: first_pass`)
the second captures both in its first pass, the backward first: that step runs no eager first pass, whose
freed blocks the default pool would hold beside the graphs' growing pool. Without, the second captures the
recompute-and-backward in its backward, the third the first pass.
Inputs are copied into static buffers shared by every layer, and each layer's output stays in its
buffer as the next layer's input. The backward graph calls `torch.autograd.grad` and writes the
parameter gradients into one flat buffer per dtype; after the replay one clone of each gives
every parameter a view of it as `.grad` (parameter hooks do not run). All graphs allocate from one private pool per device
that nothing outlives a replay in, so all layers share one layer's working set
(`memory_allocated` no longer counts it; `memory_reserved` does). A signature that does not
capture runs eagerly from then on, with one warning; a layer whose signatures keep changing
stops capturing. Offloaded layers page their MLP gate product E through one of two static
buffers (`GateKeeper`). A layer tied to others beyond its hidden states (`kestrel.recompute.linked`)
takes its ties as further static inputs and outputs (`kestrel.recompute.linked_graphs`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Any, Callable

import torch
from torch import nn

from kestrel.recompute.capture_stream import capture_on, pool_keeper, warm_stream
from kestrel.recompute.graph_grads import flat_slots, set_grads
from kestrel.recompute.graph_state import _Device, _Graphs, _LayerState, GateKeeper
from kestrel.recompute.graph_inputs import graphable, NotGraphable, StaticBuffers, signature, substitute
from kestrel.recompute.linked import LinkedCall
from kestrel.recompute.linked_graphs import GraphLinks, feed_dw, grad_lists, split_grads
from kestrel.kernels import dispatch, nf4

log = logging.getLogger("kestrel")

# Signatures kept captured per layer (a first-pass and a backward graph each). Batches are laid out
# in a bounded set of shapes (`kestrel.data.collate.bucket_width`), which a run cycles through.
GRAPHS_PER_LAYER = 24
MAX_CAPTURES = 4 * GRAPHS_PER_LAYER  # captures per layer before giving up on it: its signatures do not repeat


class GraphRegistry:
    """One run's CUDA graphs: each layer's graphs and counters, and per device the static
    buffers, the graphs' memory pool and the capture stream. Dropping it (`release`, or the run
    ending) gives their memory back. `capture_ahead`: a layer's recompute-and-backward graph is captured
    in the first pass of its signature's second sighting, not in that step's backward (`GraphedLayer`).
    `on_steps`: the graphs capture on the steps' own stream (`performance.capture_stream: steps`,
    `kestrel.recompute.capture_stream`), the one current when a device's graphs are first made."""

    def __init__(self, capture_ahead: bool = False, on_steps: bool = False) -> None:
        self.capture_ahead, self.on_steps = capture_ahead, on_steps
        self.devices: dict[torch.device, _Device] = {}
        # Kept across `release`: cuBLAS keeps a workspace per handle and stream (32 MiB, two handles: this
        # thread's and autograd's device thread's) and never frees it, so a new stream per release leaked
        # 64 MiB of allocated memory each time (bench/RESULTS.md, session 44)
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.buffer_sizes: dict[tuple, int] = {}  # what the static buffers were asked for before the last `release`
        self.layers: weakref.WeakKeyDictionary[nn.Module, _LayerState] = weakref.WeakKeyDictionary()
        self.loras: weakref.WeakKeyDictionary[nn.Module, list[nn.Module]] = weakref.WeakKeyDictionary()
        self.warned: set[str] = set()
        self.dropped = 0  # graphs dropped with a replaced static storage (`drop_viewing`)
        # Graphs captured (first passes and backwards) since the registry was made, releases included (never reset):
        # a training forward in which it grew is left out of the graph choice's times (`Recompute.spoil_after_capture`)
        self.captured = 0

    def device(self, device: torch.device) -> _Device:
        if device not in self.devices:
            drop = _weak_call(self.drop_viewing)  # weak: the registry's memory goes when it does
            stream = capture_on(torch.cuda.current_stream(device), torch.cuda.default_stream(device),
                                lambda: self._side_stream(device), self.on_steps)
            pool = torch.cuda.graph_pool_handle()
            self.devices[device] = _Device(StaticBuffers(drop, self.buffer_sizes), pool, stream, pool_keeper(pool, stream))
        return self.devices[device]

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def drop_viewing(self, old: torch.Tensor) -> None:
        """Drop the graphs that address `old`, a static storage just replaced by a larger one, so
        that it is freed: their signatures capture again, on the new storage, at their next
        sighting (a call holding one for its backward keeps it until then). Without this, a run
        whose layouts come in growing sizes would keep a storage for each size it grew through."""
        ptr = old.untyped_storage().data_ptr()
        for state in self.layers.values():
            stale = [key for key, g in state.graphs.items()
                     if any(t.untyped_storage().data_ptr() == ptr for t in g.buffers())]
            for key in stale:
                del state.graphs[key]
            self.dropped += len(stale)

    def state(self, layer: nn.Module) -> _LayerState:
        if layer not in self.layers:
            self.layers[layer] = _LayerState()
        return self.layers[layer]

    def warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            log.warning(message)

    def release(self) -> None:
        """Drop every captured graph and static buffer. What the layers' signatures were seen doing (their
        sightings, what their first passes kept or wrote) stays: a signature graphed again captures at its
        next sighting, rather than running eagerly once more beside the graphs captured meanwhile."""
        for state in self.layers.values():
            state.graphs.clear()
            state.captures, state.eager_backwards, state.off = 0, 0, False
        self.buffer_sizes = {key: n for dev in self.devices.values() for key, n in dev.buffers.asked.items()}
        self.devices.clear()
        self.dropped = 0

    def stats(self) -> dict[str, int]:
        """Graphs captured, those keeping a gate product (and those keeping other tensors: an attention
        output) in static buffers, linked calls' backward
        graphs, input copies made so far, and graphs dropped with a replaced storage (tests, profiling)."""
        states = list(self.layers.values())
        graphs = [g for state in states for g in state.graphs.values()]
        return {
            "forward": sum(g.forward is not None for g in graphs),
            "backward": sum(g.backward is not None for g in graphs),
            "failed": sum(g.failed for g in graphs),
            "gates": sum(g.gate is not None for g in graphs),
            "kept": sum(bool(g.kept) for g in graphs),
            "linked": sum(g.links is not None and g.backward is not None for g in graphs),
            "eager_backwards": sum(state.eager_backwards for state in states),
            "copies": sum(d.buffers.copies for d in self.devices.values()),
            "dropped": self.dropped,
        }


def _weak_call(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """`method` held by a weak reference to its object: a no-op once the object is gone."""
    ref = weakref.WeakMethod(method)

    def call(t: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(t)

    return call


def layer_state(layer: nn.Module, registry: GraphRegistry) -> tuple:
    """What decides which kernels a layer's forward launches, beyond its arguments."""
    loras = registry.loras.get(layer)
    if loras is None:
        loras = registry.loras[layer] = [m for m in layer.modules() if hasattr(m, "lora_A")]
    adapters = tuple(
        (tuple(m.active_adapters), m.merged, m.disable_adapters, tuple(m.scaling.get(a) for a in m.active_adapters))
        for m in loras
    )
    params = tuple((p.data_ptr(), p.requires_grad) for p in layer.parameters())
    autocast = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    return layer.training, adapters, params, autocast, dispatch.forced_backend()


# --- One call of a layer -------------------------------------------------------------------------


class GraphedLayer:
    """One call of a checkpointed decoder layer, as HF's checkpointing hands it over: `run`, a
    partial of the layer's `__call__` holding its keyword arguments, and positional `args`;
    `linked`: its ties beyond the hidden states (`kestrel.recompute.linked`), if any.

    Calling it runs the first pass: under no_grad its graph once captured, else eagerly (the
    recompute, with grad on, always goes through `backward`); a linked call returns
    (y, *what it wrote), as `LinkedCall.first_pass`. `backward(hidden, grad_out, recompute,
    grad_written)` replays the recompute-and-backward graph, sets the parameters' gradients and
    returns (dX, *the linked inputs' gradients), or None when this call is not graphed (the
    caller then runs eagerly).
    """

    def __init__(
        self, run: functools.partial, hidden: torch.Tensor, args: tuple, registry: GraphRegistry,
        linked: LinkedCall | None = None, observe: bool = False,
    ) -> None:
        self.registry = registry
        self.observe = observe  # an eager forward: count the sighting, remember what it keeps, capture nothing
        self.call, self.args, self.kwargs = run.func, args, run.keywords
        self.layer: nn.Module = run.func.__self__
        self.links = GraphLinks(linked, run.keywords) if linked is not None else None
        self.masked = self.links.masked(args, self.kwargs) if self.links is not None else (args, self.kwargs)
        self.leaves: list[torch.Tensor] = []
        self.graphs: _Graphs | None = None
        self.gate: GateKeeper | None = None
        self.kept: tuple[GateKeeper, ...] = ()  # further tensors kept between the passes (attention out, lse)
        self.key: Any = None
        self.seen: Any = None  # the key and the gate buffer this call uses
        if registry.state(self.layer).off:
            return
        try:
            ties = self.links.key(hidden.device) if self.links is not None else None
            self.key = (tuple(hidden.shape), hidden.dtype, hidden.device,
                        signature(self.masked, self.leaves), ties, layer_state(self.layer, registry))
        except NotGraphable as exc:
            registry.warn_once(f"CUDA graphs off for some decoder layers: {exc}")

    def _lookup(self, hidden: torch.Tensor, gate: GateKeeper | None) -> _Graphs | None:
        """This call's graphs: made on its signature's second sighting, None on its first."""
        state = self.registry.state(self.layer)
        if self.key is None or state.off:
            return None
        seen = self.seen
        # Graphs read the NF4 workspace they saw, so its generation keys them; not the sightings,
        # or the layer whose first pass grew the workspace would take a step more to be graphed.
        key = (seen, nf4.WORKSPACE.generation)
        graphs = None if self.observe else state.graphs.get(key)
        if graphs is not None:
            state.graphs.move_to_end(key)
            return None if graphs.failed else graphs
        if len(state.seen) > 64:
            state.seen.clear()
        state.seen[seen] = state.seen.get(seen, 0) + 1
        if self.observe:
            return None
        like, written = state.gate_like.get(seen), state.wrote.get(seen)
        if state.seen[seen] < 2 or self.links is not None and written is None:
            return None
        if state.captures >= MAX_CAPTURES:
            state.off = True
            self.registry.warn_once("CUDA graphs off for decoder layers: their input shapes keep changing")
            return None
        bufs = self.registry.device(hidden.device).buffers
        graphs = _Graphs(bufs.like("x", hidden), [bufs.like(("arg", i), t) for i, t in enumerate(self.leaves)])
        if like is not None:
            graphs.gate = bufs.get_strided(("gate", gate.slot), *like, hidden.device)
        kept_like = state.kept_like.get(seen)
        if kept_like is not None:
            graphs.kept = [bufs.get_strided(("kept", i, keeper.slot), *shape, hidden.device)
                           for i, (keeper, shape) in enumerate(zip(self.kept, kept_like))]
        if self.links is not None:
            graphs.links = self.links.allocate(bufs, written, hidden.device)
        state.graphs[key] = graphs
        state.captures += 1
        while len(state.graphs) > GRAPHS_PER_LAYER:
            state.graphs.popitem(last=False)
        return graphs

    def eager(self, hidden: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.links is None:
            return self.call(hidden, *self.args, **self.kwargs)
        out = self.links.linked.first_pass(hidden)
        if self.seen is not None:  # what it wrote: its graphs' outputs
            self.registry.state(self.layer).wrote[self.seen] = self.links.written_like()
        return out

    def _feed(self, bufs: StaticBuffers, g: _Graphs, hidden: torch.Tensor) -> None:
        bufs.feed(g.x, hidden)
        for buf, t in zip(g.leaves, self.leaves):
            bufs.feed(buf, t)
        if g.links is not None:
            self.links.feed(bufs, g.links)

    def _static_call(
        self, g: _Graphs, inputs: list[torch.Tensor] | None = None,
    ) -> Callable[[torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]:
        """h -> (y, [the tensors a linked call wrote]) on the static buffers; `inputs`: the linked
        inputs to use instead of their static buffers (the backward's leaves)."""
        args, kwargs = substitute(self.masked, iter(g.leaves))
        if self.links is None:
            return lambda h: (self.call(h, *args, **kwargs), [])
        return self.links.bind(self.call, args, kwargs, g.links.links if inputs is None else inputs, g.links.written)

    def __call__(
        self, hidden: torch.Tensor, gate: GateKeeper | None = None, alone: bool = False,
        kept: tuple[GateKeeper, ...] = (), recompute: Callable[[Callable, torch.Tensor], Any] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The first pass (under no_grad). `gate`: where offloaded checkpointing keeps this call's
        MLP gate product; the graphs keep it in a static buffer, which `gate` copies out; `kept`: the
        same for further tensors (a kept attention output and its logsumexp). `alone`:
        a no-grad forward that no backward follows (a reference pass): its first-pass graph is
        captured once the layer holds a backward graph of another signature (the pool's order).
        `recompute`: the checkpoint's (as `backward` takes it), for a backward graph captured ahead."""
        self.gate, self.kept = gate, kept
        slots = (None if gate is None else gate.slot, tuple(k.slot for k in kept))
        self.seen = None if self.key is None else (self.key, *slots)
        g = self.graphs = None if torch.is_grad_enabled() else self._lookup(hidden, gate)
        if g is None:
            out = self.eager(hidden)
            self._remember_kept(gate, kept)
            return out
        if gate is not None:
            gate.bind(g.gate)
        for i, keeper in enumerate(kept):  # none kept by the first sighting: none kept now
            keeper.bind(g.kept[i] if g.kept else None)
        # Captured once the backward graph is: the pool's segments are then cut for the
        # backward's larger working set, and the first pass fits into them (the other way round
        # the pool grows; bench/RESULTS.md, QLoRA "Session 12"). Until then it runs eagerly.
        first = g.forward is not None or (g.backward is not None if not alone else self._holds_backward())
        if not first and not alone and recompute is not None and self.registry.capture_ahead and g.links is None:
            first = self._capture_backward_ahead(g, hidden, recompute, (gate, *kept))
        out = self._first_pass(g, hidden) if first else self.eager(hidden)
        for keeper in (gate, *kept) if gate is not None else kept:
            keeper.copy_out()
        return out

    def _remember_kept(self, gate: GateKeeper | None, kept: tuple[GateKeeper, ...]) -> None:
        """After an eager first sighting: the shapes of what it kept, for its graphs' static buffers."""
        if self.seen is None:
            return
        state = self.registry.state(self.layer)
        if gate is not None and gate.like is not None:
            state.gate_like[self.seen] = gate.like
        if kept and all(k.like is not None for k in kept):
            state.kept_like[self.seen] = [k.like for k in kept]

    def _first_pass(self, g: _Graphs, hidden: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The first pass's graph replayed (captured on its first call here); eager if it does not capture."""
        bufs = self.registry.device(hidden.device).buffers
        self._feed(bufs, g, hidden)
        if g.forward is None:
            layer = self._static_call(g)
            wrote = g.links.wrote if g.links is not None else []

            def body() -> None:
                y, written = layer(g.x)
                for buf, w in zip(wrote, written):  # before y overwrites the input they came from
                    buf.copy_(w)
                g.x.copy_(y)

            g.forward = self._capture(g, body)
        if g.forward is None:
            return self.eager(hidden)
        g.forward.replay()
        out = g.x.clone()
        bufs.hold(g.x, out)  # the next layer's input: already in the buffer
        return out if g.links is None else (out, *self.links.publish_replayed(g.links))

    def _capture_backward_ahead(self, g: _Graphs, hidden: torch.Tensor, recompute: Callable,
                                keepers: tuple[GateKeeper | None, ...]) -> bool:
        """Capture the recompute-and-backward graph before this call's first pass (`capture_ahead`); True
        when it captured. A capture records without running, so the buffers' contents do not matter yet;
        the keepers read as holding their bound buffers meanwhile, so the recompute recorded reads what the
        first pass will keep, as a capture in the backward does (where the first pass did not keep it after
        all, `backward` finds the keeper empty and runs eagerly). The incoming gradient is shaped as the input."""
        bufs = self.registry.device(hidden.device).buffers
        if g.grad is None:
            g.grad = bufs.like("grad", hidden)
        with contextlib.ExitStack() as held:
            for keeper in keepers:
                if keeper is not None:
                    held.enter_context(keeper.as_held())
            g.backward = self._capture(g, self._backward_body(g, bufs, recompute))
        return g.backward is not None

    def _holds_backward(self) -> bool:
        return any(g.backward is not None for g in self.registry.state(self.layer).graphs.values())

    def backward(
        self, hidden: torch.Tensor, grad_out: torch.Tensor,
        recompute: Callable[[Callable[[torch.Tensor], Any], torch.Tensor], Any],
        grad_written: tuple[torch.Tensor | None, ...] = (),
    ) -> tuple[tuple[torch.Tensor | None, ...] | None, torch.Tensor | None]:
        """((dX, *the linked inputs' gradients), None) for grad_out and a linked call's
        `grad_written` (what it wrote), the parameters' gradients set; or (None, hidden): run
        eagerly. The caller hands `hidden` over without keeping it: once in the static buffer it
        is let go before the replay (its memory serves the replay's eager neighbours). dX is the
        static incoming-gradient buffer itself, which the layer below's backward reads in place
        (no clone: autograd hands it straight to that backward, and a replay only overwrites it
        after it has been read). `recompute(fn, h)` runs fn(h) as the checkpoint's recompute."""
        g = self.graphs
        if g is None or g.failed:
            return None, hidden
        if (grad_out.shape != hidden.shape or not grad_out.is_contiguous()
                or g.gate is not None and self.gate.take() is None  # E not kept after all: recompute it
                or g.kept and any(t is None for t in [k.take() for k in self.kept])):  # each taken back
            self.registry.state(self.layer).eager_backwards += 1
            return None, hidden
        bufs = self.registry.device(hidden.device).buffers
        if g.grad is None:
            g.grad = bufs.like("grad", grad_out)
        self._feed(bufs, g, hidden)
        del hidden
        bufs.feed(g.grad, grad_out)
        del grad_out
        if g.links is not None:
            feed_dw(bufs, g.links.dw, grad_written)
        if g.backward is None:
            g.backward = self._capture(g, self._backward_body(g, bufs, recompute))
            if g.backward is None:
                return None, g.x.clone()
        g.backward.replay()
        bufs.hold(g.grad, g.grad)  # the layer below's incoming gradient: already in the buffer
        set_grads(g)
        if g.links is None:
            return (g.grad,), None
        return (g.grad, *(d.clone() if ok else None for d, ok in zip(g.links.dlinks, g.links.got))), None

    def _backward_body(self, g: _Graphs, bufs: StaticBuffers, recompute: Callable) -> Callable[[], None]:
        """The captured backward: recompute, then the gradients of the input, the linked inputs
        and the trainable parameters into the static buffers (`g.params` keeps the parameters
        that got one, `g.links.got` the linked inputs that did)."""
        params = [p for p in self.layer.parameters() if p.requires_grad]
        slots = flat_slots(g, bufs, params)
        lb = g.links
        wants = self.links.wants if lb is not None else []
        got: list[bool] = []

        def body() -> None:
            h = g.x.detach().requires_grad_(True)
            leaves = [b.detach().requires_grad_(w) for b, w in zip(lb.links, wants)] if lb is not None else []
            y, written = recompute(self._static_call(g, leaves), h)
            if not isinstance(y, torch.Tensor):
                raise NotGraphable("the layer returns more than a tensor")
            outputs, inputs, douts = grad_lists(h, y, g.grad, written, lb.dw if lb is not None else [], leaves, params)
            dh, dlinks, dparams = split_grads(torch.autograd.grad(outputs, inputs, douts, allow_unused=True),
                                              wants, len(params))
            got[:] = [d is not None for d in dparams]
            for (p, i, start), d in zip(slots, dparams):
                if d is not None:
                    g.flats[i][start : start + p.numel()].view(p.shape).copy_(d)
            if lb is not None:
                lb.got = [d is not None for d in dlinks]
                for buf, d in zip(lb.dlinks, dlinks):
                    if d is not None:
                        buf.copy_(d)
            g.grad.copy_(dh)

        def run() -> None:
            body()
            g.params = [slot for slot, ok in zip(slots, got) if ok]

        return run

    def _capture(self, g: _Graphs, body: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        """Capture `body` (recording, not running it: the static inputs stay as fed); None, and
        this signature eager from now on, when it does not capture. No eager warm-up run of the
        layer on the capture stream: its first sighting already ran eagerly (kernels compiled,
        workspaces sized), and a warm-up there would take a layer's working set in new blocks
        (the allocator keeps blocks per stream; bench/RESULTS.md, QLoRA "Session 8")."""
        dev = self.registry.device(g.x.device)
        graph = torch.cuda.CUDAGraph()
        try:
            # The capture empties the allocator's cache when it starts; emptied before the capture
            # stream's cuBLAS workspace is made, the eager cache and that workspace never peak together.
            torch.cuda.empty_cache()
            warm_stream(dev.stream)
            with torch.cuda.graph(
                graph, pool=dev.pool, stream=dev.stream, capture_error_mode="thread_local"
            ):
                body()
        except Exception as exc:  # noqa: BLE001 - any failure: this signature runs eagerly
            g.failed = True
            self.registry.warn_once(f"a decoder layer did not capture as a CUDA graph ({type(exc).__name__}: {exc}); "
                       "it runs eagerly")
            return None
        self.registry.captured += 1
        return graph


def call_key(run: functools.partial, hidden: torch.Tensor, args: tuple, linked: LinkedCall | None = None) -> Any:
    """The signature a layer's graphs replay for (input shape, the other arguments' shapes and
    values, a linked call's ties: `GraphLinks.key`), or None when a replay could not reproduce the call."""
    try:
        if linked is None:
            return tuple(hidden.shape), hidden.dtype, signature((args, run.keywords), [])
        links = GraphLinks(linked, run.keywords)
        return (tuple(hidden.shape), hidden.dtype, signature(links.masked(args, run.keywords), []),
                links.key(hidden.device))
    except NotGraphable:
        return None


def wrap(
    run: Callable[..., torch.Tensor], hidden: torch.Tensor, args: tuple, graphs: GraphRegistry | None,
    linked: LinkedCall | None = None, observe: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor] | LinkedCall | GraphedLayer:
    """What a layer checkpoint runs for this call: a `GraphedLayer` of the run's `graphs` when
    given (the run's choice for this forward, or with `observe` an eager forward the graphs count as a
    sighting) and the call can be graphed; else `linked` when the call has ties (`kestrel.recompute.linked`),
    else `run` with `args`."""
    if graphs is not None and graphable(run, hidden):
        return GraphedLayer(run, hidden, args, graphs, linked, observe)
    if linked is not None:
        return linked
    return (lambda h: run(h, *args)) if args else run
