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
pinned host buffers and the side stream come from `kestrel.recompute.host_memory`, the kept tensors
from `kestrel.recompute.host_tensors`. Where the run keeps attention outputs (`keep_attention`, offload),
each layer's first pass pages its causal attention's output and logsumexp out too (a graphed one
through two static buffers, as its gate product),
and its recompute runs no attention forward (`kestrel.model.kept_attention`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import weakref
from typing import Any, Callable

from kestrel import env
from kestrel.config import PerformanceSettings
from kestrel.constants import BACKWARD_CAPTURE_MODES, KEEP_ATTENTION_MODES, KEEP_PROJECTION_MODES, KEEP_QKV_MODES
import torch
from torch import nn

from kestrel.kernels.lora.casts import cast_fresh
from kestrel.model.kept_attention import KeptBytes, Keeping
from kestrel.model.registry import family_for
from kestrel.recompute import layer_graphs, no_grad
from kestrel.recompute.capture_stream import capture_stream_mode
from kestrel.recompute.gate_share import gate_share, paged_gate_layers, pages_gate_out
from kestrel.recompute.graph_choice import CudaClock, Decision, GraphChooser, GraphMode
from kestrel.recompute.host_link import FirstPassTimes
from kestrel.recompute.host_tensors import _HostCopy, _KeptGate, KeptAttentionOutput, OffloadState
from kestrel.recompute.linked import LinkedCall
from kestrel.recompute.mlp_deferral import defer_mode, MLPDeferral

log = logging.getLogger("kestrel")


class LayerCheckpoint(torch.autograd.Function):
    """y = layer(x), keeping only x (on the GPU, or in pinned CPU memory when offloading,
    `_HostCopy`); backward recomputes the layer from x.

    Backward: x is brought back (copied to the device when offloaded), the layer is re-run with
    autograd on (`owner.recomputing` is True meanwhile: y's values are not used, only its
    graph), and `torch.autograd.backward(y, dy)` accumulates the parameter gradients and gives dx.
    `owner.gate` is the layer's gate-product store during both passes (offload), `owner.attention` its
    attention-output store (`keep_attention`).
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
        ctx.attention = None
        if owner.offload and owner.keep_attention != "off":
            auto = owner.keep_attention == "auto"
            extras = owner.extras_at(hidden)
            ctx.attention = ctx.saved_input.attention = KeptAttentionOutput(
                owner.offloaded, slot=ctx.saved_input.depth % 2, only_long=auto,
                link=owner.attention_keeps_up if auto else None, projection=extras.projection, qkv=extras.qkv)
        owner.gate, owner.attention = ctx.gate, ctx.attention
        try:
            with torch.no_grad():
                if isinstance(run, layer_graphs.GraphedLayer):
                    return run(hidden, ctx.gate, kept=ctx.attention.keepers() if ctx.attention is not None else (),
                               recompute=owner.recompute)
                if isinstance(run, LinkedCall):  # `links` are its inputs: (y, *what it wrote)
                    return run.first_pass(hidden)
                return run(hidden)
        finally:
            owner.gate = owner.attention = None

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *grad_written: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, ctx.saved_input = ctx.saved_input, None
        owner, run = ctx.owner, ctx.run
        owner.gate, owner.attention = ctx.gate, ctx.attention
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
            owner.gate = owner.attention = ctx.gate = ctx.attention = ctx.run = ctx.owner = None
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
        shared_state: str | None = None, deferral: MLPDeferral | None = None, keep_attention: str = "off",
        keep_projection: bool = False, keep_qkv: bool = False,
        backward_capture: str = PerformanceSettings.backward_graph_capture,
        capture_stream: str = PerformanceSettings.capture_stream,
    ) -> None:
        self.offload, self.chooser, self.gate_share = offload, chooser, gate_share
        self.deferral = deferral if deferral is not None else MLPDeferral()  # whether recomputed MLPs defer
        self.shared_state = shared_state  # the layers' keyword holding tensors shared between them (`LinkedCall`)
        self.first = weakref.ref(first_layer) if first_layer is not None else None
        self._layers: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the decoder layers calling it
        self.graphed = False  # this forward's choice
        # This forward runs its layout's first sighting eagerly (`GraphChooser.first_sighting`): the layer graphs
        # count it as theirs, so a later graphed forward of the layout captures at once instead of running one more
        # eager forward beside the pool the graphs of other layouts hold (bench/RESULTS.md, session 43)
        self.observing = False
        self.no_grad_active, self.no_grad_graphed = False, False  # inside `no_grad_forwards`; its forward's choice
        self.backward_capture = backward_capture  # `performance.backward_graph_capture`: backward | first_pass
        self.capture_stream = capture_stream  # `performance.capture_stream`: side | steps (the loop enters `steps_stream`)
        self.graphs = layer_graphs.GraphRegistry(capture_ahead=backward_capture == "first_pass",
                                                 on_steps=capture_stream == "steps")
        self.holds_graphs = False
        self._captures_seen = 0  # `graphs.captured` at the last training forward's start
        self.offloaded = OffloadState()
        # While a layer's checkpoint runs: True in its recompute for backward (its output's values
        # are thrown away, only its graph is used, so the decoder layer tells its MLP to skip the
        # down product and skips the last residual sum); its gate-product store (offload).
        self.recomputing = False
        self.gate: _KeptGate | None = None
        self.keep_attention = keep_attention  # off | auto | on: offloaded layers page their attention output out
        self.keep_projection = keep_projection  # and, with it, their output projection's output
        self.keep_qkv = keep_qkv  # and their Q, K and V projections' outputs
        # Bytes a row of what a keeping layer may page beside its input (0 for an extra the run does not keep)
        self.kept_sizes = KeptBytes()
        self.attention: KeptAttentionOutput | None = None  # while a layer's checkpoint runs: its store
        self.first_pass = FirstPassTimes(chooser.clock)  # the forward's first layer's first pass, by row count
        self._sightings: dict[int, int] = {}  # rows -> training forwards seen (offload)
        self._ran_graphed: set[int] = set()  # row counts some forward ran as CUDA graphs
        self.kept: dict[int, Keeping] = {}  # keep_attention auto: each timed row count's answer
        self.attention_asked: set[int] = set()  # row counts at which a layer asked it
        self.on_attention: Callable[[int, bool, str], None] | None = None  # (rows, kept, why), once a row count

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
        first = self.starts_forward(run)
        if first and self.offload:
            self._hand_over_times()
        if first and layer_graphs.graphable(run, hidden):
            self.spoil_after_capture()
            key = layer_graphs.call_key(run, hidden, args, linked)
            tokens = hidden.numel() // max(hidden.shape[-1], 1)
            self.graphed = key is not None and self.chooser.begin(key, tokens, f"{tuple(hidden.shape[:-1])} tokens")
            self.observing = key is not None and not self.graphed and self.chooser.first_sighting(key)
            if self.graphed:
                self._ran_graphed.add(tokens)
            if self.holds_graphs and (not self.chooser.any_graphed() or self.chooser.runs_alone(key)):
                self.release()  # eager from here on, or an undecided layout's eager forward: memory back first
                self.chooser.restart()
            self.holds_graphs |= self.graphed
        timed = self._start_timing(hidden, linked) if first and self.offload else None
        registry = self.graphs if self.graphed or self.observing else None
        wrapped = layer_graphs.wrap(run, hidden, args, registry, linked, observe=self.observing)
        if linked is not None:  # `LinkedCall` or a `GraphedLayer` of it: its ties are the checkpoint's too
            y, *written = LayerCheckpoint.apply(wrapped, self, hidden, *linked.inputs)
            linked.publish(tuple(written))
            return y
        y = LayerCheckpoint.apply(wrapped, self, hidden)
        if timed is not None:
            self.first_pass.stop(timed)
        return y

    def spoil_after_capture(self) -> None:
        """At a training forward's start: where the forward that ends now captured layer graphs, its time is left
        out of the graph choice's (`GraphChooser.spoil`). Captures follow every drop of the graphs and every
        outgrown static buffer; timed, they made a padded run's graphed layouts look slower than eager
        (bench/RESULTS.md, session 44)."""
        if self.graphs.captured != self._captures_seen:
            self.chooser.spoil()
        self._captures_seen = self.graphs.captured

    def _hand_over_times(self) -> None:
        """At an offloaded forward's first layer, before anything is decided for this forward: hand the
        run's MLP deferral the first-pass times of earlier forwards that the device has finished
        (`MLPDeferral.record_layer_time`), so its answers change only between forwards, never
        between a layer's first pass and its recompute."""
        for rows, seconds in self.first_pass.finished():
            self._hand_over(rows, seconds)

    def _start_timing(self, hidden: torch.Tensor, linked: LinkedCall | None) -> int | None:
        """Where the run wants this row count's first pass timed (`wants_layer_time`) and this is not its
        first forward (which compiles and tunes kernels: its time says little), start timing this
        layer's first pass (`FirstPassTimes`) and return the row count. The timing holds the stream
        idle before the pass, which would skew a step the graph chooser times: that forward's time
        is left out (`GraphChooser.spoil`). A layer with ties beyond its hidden states
        (`LinkedCall`) is not timed (its MLPs stay deferred)."""
        rows = hidden.numel() // max(hidden.shape[-1], 1)
        seen = self._sightings[rows] = self._sightings.get(rows, 0) + 1
        if linked is not None or seen < 2 or self.first_pass.timing(rows):
            return None
        if not self._wants_layer_time(rows, hidden.device):
            return None
        self.chooser.spoil()
        self.first_pass.start(rows, hidden.is_cuda)
        return rows

    def _hand_over(self, rows: int, seconds: float) -> None:
        """A first pass's time is in: answers at `rows` rows are decided again from it, unless a forward
        of that row count already ran as CUDA graphs (they may have captured the untimed answers, and a
        first pass and a recompute captured under different answers would page what nothing reads):
        then the untimed answers stay."""
        again = rows not in self._ran_graphed
        self.deferral.record_layer_time(rows, seconds, decide_again=again)
        if not again:
            self.kept.setdefault(rows, Keeping())

    def _wants_layer_time(self, rows: int, device: torch.device) -> bool:
        """Whether a layer's first pass at `rows` rows is still to be timed for the link's sake: the
        MLP deferral asks (`fit`), or a layer asked `keep_attention: auto` whether to keep its
        attention output at this row count (long enough rows), which it does only where the link
        keeps up (`attention_keeps_up`)."""
        if self.deferral.wants_layer_time(rows, device):
            return True
        return rows in self.attention_asked and device.type == "cuda" and not self.deferral.link.timed(rows)

    def attention_keeps_up(self, rows: int, hidden: int, device: torch.device) -> bool:
        """`keep_attention: auto`'s link rule: a layer keeps its attention output at `rows` rows only
        where what its first pass pages out (its input, that output, and its MLP's gate product where
        the MLP keeps whole rows at this row count) ends within that pass
        (`kestrel.recompute.host_link`); not while the row count is untimed (asking marks it to be
        timed). The extras ride along in order while the link has room for them: the output projection's
        output (`keep_projection`), then Q, K and V (`keep_qkv`), each doing the same recompute work a byte;
        where it has room for fewer, fewer are kept (`kept`). Each timed row count is decided once and
        reported (`on_attention`)."""
        known = self.kept.get(rows)
        if known is not None:
            return known.attention
        self.attention_asked.add(rows)
        sizes = self.kept_sizes
        levels = [Keeping(True, p, q) for p, q in ((True, True), (True, False), (False, True), (False, False))
                  if (sizes.projection or not p) and (sizes.qkv or not q)]
        tried: list[str] = []
        for level in levels:
            keeps_up, why = self._fits(rows, hidden, device, sizes.of(level))
            if keeps_up is None:
                return False
            tried.append(why if len(levels) == 1 else f"{level.describe()}: {why}")
            if keeps_up:
                break
        self.kept[rows] = level if keeps_up else Keeping()
        if self.on_attention is not None:
            self.on_attention(rows, keeps_up, "; ".join(tried))
        return keeps_up

    def _fits(self, rows: int, hidden: int, device: torch.device, kept: int) -> tuple[bool | None, str]:
        """Whether a layer paging its input and `kept` bytes a row more (with its MLP's gate product
        where whole rows are kept at `rows`) ends within its first pass (None: untimed), and the
        host holds every layer's pages (`MLPDeferral.host_short`); and why."""
        per_row = hidden * 2 + kept + self.deferral.paged_bytes_per_row(rows)
        keeps_up, why = self.deferral.link.keeps_up(rows, per_row, device)
        if keeps_up:  # the link carries them; the host must hold every layer's
            short = self.deferral.host_short(len(self._layers) * rows * (hidden * 2 + kept))
            if short is not None:
                return False, f"the layers' inputs and kept outputs {short}"
        return keeps_up, why

    def extras_at(self, hidden: torch.Tensor) -> Keeping:
        """What a layer checkpointing `hidden` (..., hidden size) keeps with its attention output (its
        `projection` and `qkv`): as `keep_projection` and `keep_qkv` say under `keep_attention: on`; under
        `auto`, the answer for its row count (`attention_keeps_up`), decided here where a layer already
        asked and the link is timed, so each layer of a forward gets the same answer; nothing while
        undecided (nor is the attention output kept)."""
        if self.keep_attention == "off" or not (self.keep_projection or self.keep_qkv):
            return Keeping()
        if self.keep_attention == "on":
            return Keeping(True, self.keep_projection, self.keep_qkv)
        rows = hidden.numel() // max(hidden.shape[-1], 1)
        if rows not in self.kept and rows in self.attention_asked:
            self.attention_keeps_up(rows, hidden.shape[-1], hidden.device)
        return self.kept.get(rows, Keeping())

    def kept_bytes_at(self, rows: int) -> int:
        """Bytes a row that a keeping layer pages beside its input at `rows` rows (`MLPDeferral.kept_bytes`):
        what `keep_attention` keeps there; under `auto`, what was decided, or the attention output alone
        where a layer asked and nothing is decided yet (the extras yield to whole MLP rows)."""
        if self.keep_attention == "off":
            return 0
        if self.keep_attention == "on":  # an extra the run does not keep has no bytes
            return self.kept_sizes.of(Keeping(True, True, True))
        if rows in self.kept:
            return self.kept_sizes.of(self.kept[rows])
        return self.kept_sizes.attention if rows in self.attention_asked else 0

    def release(self) -> None:
        """Drop the run's CUDA graphs and give their memory back. A captured graph caught in a reference
        cycle (a checkpoint's context, a linked call's ties) would hold the graphs' pool until the collector's
        next pass, and the eager steps that follow would reserve their working set beside it: collected here
        (a release is rare: an all-eager decision, a re-timing), then the emptied cache frees the pool."""
        self.graphs.release()
        self.holds_graphs = False
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()

    def starts_forward(self, run: Callable[..., torch.Tensor]) -> bool:
        """Whether `run` is the call of the forward's first decoder layer."""
        layer = getattr(getattr(run, "func", None), "__self__", None)
        return self.first is not None and layer is self.first()

    def layers(self) -> list[nn.Module]:
        return list(self._layers)  # the decoder layers checkpointed through this run's recompute


def keep_qkv_mode(configured: str) -> str:
    """The run's `keep_qkv`: KESTREL_KEEP_QKV (off | on, a debugging override) wins."""
    return env.override("KESTREL_KEEP_QKV", configured, KEEP_QKV_MODES)


def backward_capture_mode(configured: str) -> str:
    """The run's `backward_graph_capture`: KESTREL_BACKWARD_CAPTURE (backward | first_pass, a debugging override) wins."""
    return env.override("KESTREL_BACKWARD_CAPTURE", configured, BACKWARD_CAPTURE_MODES)


def keep_projection_mode(configured: str) -> str:
    """The run's `keep_projection`: KESTREL_KEEP_PROJECTION (off | on, a debugging override) wins."""
    return env.override("KESTREL_KEEP_PROJECTION", configured, KEEP_PROJECTION_MODES)


def keep_attention_mode(configured: str) -> str:
    """The run's `keep_attention`: KESTREL_KEEP_ATTENTION (off | auto | on, a debugging override) wins."""
    return env.override("KESTREL_KEEP_ATTENTION", configured, KEEP_ATTENTION_MODES)


def graph_mode(configured: GraphMode) -> GraphMode:
    """The run's CUDA-graph mode: KESTREL_CUDA_GRAPHS (1 | 0 | auto, a debugging override)
    wins over the configured one."""
    forced = env.choice("KESTREL_CUDA_GRAPHS", {"1": "on", "on": "on", "0": "off", "off": "off", "auto": "auto"})
    return configured if forced is None else forced  # type: ignore[return-value]


def set_gradient_checkpointing(
    model: nn.Module, mode: str, cuda_graphs: GraphMode = "auto", on_decision: Callable[[Decision], None] | None = None,
    offload_gate: float = 1.0, deferral: MLPDeferral | None = None,
    keep_attention: str = PerformanceSettings.keep_attention,
    on_attention: Callable[[int, bool, str], None] | None = None,
    keep_projection: str = PerformanceSettings.keep_projection,
    keep_qkv: str = PerformanceSettings.keep_qkv,
    backward_capture: str = PerformanceSettings.backward_graph_capture,
    capture_stream: str = PerformanceSettings.capture_stream,
) -> Recompute | None:
    """Turn checkpointing `off`, `standard` (recompute each layer) or `offload` on `model`; returns
    the run's `Recompute` (None when off). `cuda_graphs` and `on_decision`: `GraphChooser`'s;
    `offload_gate`: the share of offloaded layers that page their MLP gate product out; `deferral`:
    whether a recomputed MLP defers to its backward (`kestrel.recompute.mlp_deferral`; default `memory`, or
    KESTREL_DEFER_MLP); `keep_attention` (off | auto | on): offloaded layers page their causal attention's
    output out, so their recompute runs no attention forward (KESTREL_KEEP_ATTENTION overrides; `on_attention`
    hears `auto`'s answer for each row count, `Recompute.attention_keeps_up`); `keep_projection` (off | on):
    where they do, their output projection's output too (KESTREL_KEEP_PROJECTION overrides); `keep_qkv`
    (off | on): and their Q, K and V projections' outputs (KESTREL_KEEP_QKV overrides); `backward_capture`
    (backward | first_pass): when a graphed layer's backward graph is captured (KESTREL_BACKWARD_CAPTURE overrides);
    `capture_stream` (side | steps): which stream the graphs capture on, and so which the caller runs the steps on
    (`Recompute.capture_stream`, `kestrel.recompute.capture_stream`; KESTREL_CAPTURE_STREAM overrides).

    Both modes checkpoint with our reentrant `LayerCheckpoint`. Hugging Face's
    `gradient_checkpointing_enable` is called with use_reentrant=False only to set HF's flags
    (each decoder layer then calls its `_gradient_checkpointing_func`); that function is then
    replaced by the run's `Recompute`, so no decoder layer runs torch's checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    previous = recompute_of(model)
    if previous is not None:
        previous.release()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if mode == "off":
        cast_fresh(trainable, False)
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
                          deferral=deferral if deferral is not None else MLPDeferral(defer_mode(PerformanceSettings.defer_mlp)),
                          keep_attention=keep_attention_mode(keep_attention),
                          keep_projection=keep_projection_mode(keep_projection) == "on",
                          keep_qkv=keep_qkv_mode(keep_qkv) == "on",
                          backward_capture=backward_capture_mode(backward_capture),
                          capture_stream=capture_stream_mode(capture_stream))
    recompute.on_attention = on_attention
    # Timed graphs run a layer eagerly only where the GPU sets the pace: kept casts would cost memory there and save
    # nothing (`kestrel.kernels.lora.casts`); any other mode unmarks what an earlier call marked
    cast_fresh(trainable, chooser.mode == "auto")
    if recompute.offload:  # what whole rows would page out (`kestrel.recompute.mlp_deferral`)
        recompute.deferral.paged_layers = paged_gate_layers(len(layers), recompute.gate_share)
        if recompute.keep_attention != "off":
            sizes = KeptBytes.of_model(model.config)
            recompute.kept_sizes = dataclasses.replace(sizes, projection=sizes.projection * recompute.keep_projection,
                                                       qkv=sizes.qkv * recompute.keep_qkv)
            recompute.deferral.kept_bytes = recompute.kept_bytes_at
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
