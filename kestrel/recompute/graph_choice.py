"""Whether a training forward's decoder layers replay as CUDA graphs: chosen by timing both ways.

Graphs take the host's Python off the step's path; they pay where the host, not the GPU, sets the
pace, and cost a little where it does not (static-buffer copies, a second memory pool). Where
that line falls depends on the model, the GPU, the host and the batch layout, so it is measured
on the run's own shapes instead of fitted to one: each batch layout is timed both ways on the
run's own steps and the faster way kept (`GraphChooser` says how); layouts bounded by decided
ones in token count are inferred.

`mode` "on" / "off" skips the timing (graphs always / never).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Hashable, Literal, Protocol

GraphMode = Literal["auto", "on", "off"]
GRAPH_MODES: tuple[str, ...] = ("auto", "on", "off")


class Clock(Protocol):
    """Marks points in a device's timeline and measures between two of them."""

    def mark(self) -> Any:
        """A point in the timeline now (for CUDA: an event recorded on the current stream)."""

    def seconds(self, start: Any, end: Any) -> float | None:
        """Seconds from `start` to `end`, or None while `end` has not been reached yet."""

    def drain(self) -> None:
        """Wait until the device has done all the work queued so far."""


class WallClock:
    """The host's clock: for devices with no timeline of their own, and tests."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now

    def mark(self) -> float:
        return self.now()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def drain(self) -> None:
        pass


class CudaClock:
    """CUDA events on the current stream; read only once passed, so timing never syncs."""

    def mark(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float | None:
        return start.elapsed_time(end) / 1e3 if end.query() else None

    def drain(self) -> None:
        import torch

        torch.cuda.synchronize()


@dataclasses.dataclass
class Decision:
    """One layout's choice and the medians it was made from (None: inferred, not timed)."""

    layout: str
    tokens: int
    graphed: bool
    graphed_s: float | None
    eager_s: float | None
    reason: str

    def as_metrics(self) -> dict[str, Any]:
        return {"event": "cuda_graphs", **dataclasses.asdict(self)}


@dataclasses.dataclass
class _Layout:
    tokens: int
    name: str
    sightings: int = 0
    graph_warm: int = 0  # untimed graphed forwards so far
    times: dict[bool, list[float]] = dataclasses.field(default_factory=lambda: {True: [], False: []})
    decision: Decision | None = None
    recent: list[float] = dataclasses.field(default_factory=list)  # the decided way's forwards since its last check
    watch: int = 0  # forwards of the decided way between checks (0: not watched)
    retimes: int = 0  # times this layout's decision was doubted and timed again
    retiming: bool = False  # timing the other way again now: nothing is inferred for it meanwhile


class GraphChooser:
    """Per run: graphs on or off for each training forward (`begin`), chosen by timing:

    - A layout is the signature a graph replays for (the first decoder layer's input shape and its
      other arguments' shapes, `GraphChooser.begin`'s key).
    - A new layout first runs eagerly: one untimed forward (kernels compile, the allocator fills),
      then `samples` timed ones; then graphed: `warmup` untimed forward (the layer graphs capture in it:
      they counted the layout's first forward as their eager sighting, `first_sighting`), then `samples`
      timed ones. The faster way's median wins; a tie within `margin` goes to eager (no graph pool held).
      Where the two ways' samples lie `decisive` times apart or more (the slower way's fastest sample
      against the faster way's slowest), the layout is decided from the samples it has: step-to-step
      variation of that size has not been seen (an eager step varied by half on a busy host,
      bench/RESULTS.md session 33), and each eager probe of a host-bound layout is several times slower
      than its graphed steps. Eager first: a capture empties the allocator's cache, so a layout's eager
      working set and its graphs' pool are not reserved together. Nor are another layout's: an undecided
      layout's eager forwards run with every graph dropped (`runs_alone`). A forward that captured graphs
      (the backward graph one forward after the first pass's under `performance.backward_graph_capture:
      backward`, after such a drop, or its static buffers outgrown) is left out of the times by its caller
      (`spoil`): a capture is not a step's cost, and so one untimed graphed forward is enough. A decided
      layout never drops graphs: where one is decided eager beside graphed ones, its steps run beside
      their pool, the price of the speed chosen.
    - A forward's time is the time from its start to the next forward's start on the device's clock
      (CUDA events, read without a sync once they have passed), so it counts its backward, the
      optimizer step and any time the GPU sat waiting for the host. Where the way changes the
      device is drained first: a graphed step lets the host run ahead, and the queue it leaves
      would hide the host's cost of the eager step after it.
    - Cost model, to spare probing every layout of a run whose shapes vary (padded rows): the host's
      share of a step falls as its tokens grow, so once a layout of n tokens is decided graphed,
      every layout of at most n tokens is graphed, and once one of n is decided eager, every layout
      of at least n is eager, unless it is already being timed; a layout of exactly n tokens (the
      same batch with another number of samples in it) takes the decision even while being timed.
      Upward, a graphed win of R at m tokens bounds the win at n > m tokens below by R (m / n)^2 (eager time does
      not fall with more tokens; graphed time grows at most as their square), so where that is still `decisive`
      the layout of n is graphed too (`_graphed_above`).
      Layouts between the bounds are probed. A bound from a decisive graphed decision (eager
      `decisive` times slower) applies to smaller layouts already being timed too: a padded run times its
      layouts interleaved, so without it each would be probed to the end. A decision that contradicts
      the rule (graphed above an eager one) ends the inferring by bounds.
    - A timed decision is watched: its way's forwards stay timed (events, no sync), and every
      `watch` of them their median is held against the median the other way ran at when it lost.
      Where the chosen way now runs slower than that, the choice rested on samples that did not hold
      (an eager step can vary by half between steps on a busy host: DPO, bench/RESULTS.md session
      33), so the other way is timed again and the layout decided anew from the chosen way's recent
      median and the other's fresh samples; decisions inferred from it are inferred again.
      The window then doubles (watch, 2 watch, 4 watch, ...), so a run of n forwards re-times a
      layout at most log2(n / watch + 1) times. A re-timing costs `samples` forwards (after
      `warmup` ones, for graphs) of the other way, and it only starts where the two ways' times
      have come within `margin` of each other or crossed, so it is cheap exactly when the
      evidence is weak, and it is how a wrong or stale choice is undone. A graphed choice's eager
      re-timing is undecided too, so it runs with the graphs dropped.

    `on_decision(decision)` hears each choice as it is made (the run's log and metrics), re-timed
    ones included.
    """

    def __init__(
        self, mode: GraphMode = "auto", clock: Clock | None = None, warmup: int = 1, samples: int = 3,
        margin: float = 0.01, on_decision: Callable[[Decision], None] | None = None, watch: int = 12,
        decisive: float = 2.0,
    ) -> None:
        if mode not in GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
        self.mode, self.clock, self.warmup, self.samples, self.margin = mode, clock or WallClock(), warmup, samples, margin
        self.watch, self.decisive = watch, decisive
        self.on_decision = on_decision
        self.layouts: dict[Hashable, _Layout] = {}
        self._open: tuple[_Layout, bool, Any] | None = None  # the forward running now, if timed: layout, way, start
        self._last: bool | None = None  # the way the last forward ran
        self._pending: list[tuple[_Layout, bool, Any, Any]] = []  # timings whose end may not have passed
        self._drain = False  # drain before the next forward (`spoil`)

    # --- The one call a forward makes ---------------------------------------------------------

    def begin(self, key: Hashable, tokens: int, name: str = "") -> bool:
        """A training forward starts with layout `key` of `tokens` tokens: whether to graph it.
        Closes the previous forward's timing."""
        if self.mode != "auto":
            return self.mode == "on"
        self._settle()
        layout = self.layouts.get(key)
        if layout is None:
            layout = self.layouts[key] = _Layout(tokens, name or str(key))
        layout.sightings += 1
        graphed, timed = self._way(layout)
        switched = self._last is not None and graphed != self._last
        if switched or self._drain:
            self.clock.drain()
            self._drain = False
        mark = self.clock.mark()
        if self._open is not None:  # after a switch, it ends once its own work has drained
            self._pending.append((*self._open, mark))
        # Timed after a switch too: the drain leaves no queue that could hide this forward's host
        # cost, and layouts that take turns would otherwise switch at every forward, never timed.
        self._open = (layout, graphed, mark) if timed else None
        self._last = graphed
        return graphed

    def spoil(self) -> None:
        """This forward's time is not to count (something held its stream idle: `FirstPassTimes`), and
        the next forward starts on a drained device (the host ran ahead meanwhile, and the queue it
        left would hide the next forward's host cost)."""
        self._open = None
        self._drain = True

    def decided_graphed(self, key: Hashable) -> bool:
        """Whether layout `key` is decided graphed (always, with graphs forced on): what a no-grad
        forward of the same layout follows. Nothing is timed or recorded."""
        if self.mode != "auto":
            return self.mode == "on"
        layout = self.layouts.get(key)
        return layout is not None and layout.decision is not None and layout.decision.graphed

    def graphs_kept(self) -> bool:
        """Whether some layout is decided graphed (always, with graphs forced on)."""
        return self.mode == "on" or self.mode == "auto" and any(
            lay.decision is not None and lay.decision.graphed for lay in self.layouts.values())

    def decisions(self) -> list[Decision]:
        return [lay.decision for lay in self.layouts.values() if lay.decision is not None]

    def runs_alone(self, key: Hashable) -> bool:
        """Whether the forward just begun for `key` runs eagerly, in auto mode, while its layout is undecided (an eager
        timed probe, a re-timing's eager forwards) or is new: a layout's first sighting, also where the cost model
        decided it graphed at once, since layer graphs capture a signature only at its second sighting (the first
        sizes its workspaces). The caller drops any graphs it holds first (`Recompute.release`): this eager working
        set and their pool would otherwise be reserved together, above what either way needs alone, and a padded
        run's new layouts set its reserved peak just so (bench/RESULTS.md, session 44). At most 1 + `samples` such
        forwards a timing of a layout."""
        layout = self.layouts.get(key)
        return self.mode == "auto" and layout is not None and (
            layout.sightings == 1 or layout.decision is None and self._last is False)

    def restart(self) -> None:
        """The forward just begun starts now, if timed: the caller did work first that is not the forward's
        (dropping graphs: a collection pass and the allocator's cache emptied)."""
        if self._open is not None:
            self._open = (self._open[0], self._open[1], self.clock.mark())

    def first_sighting(self, key: Hashable) -> bool:
        """Whether the forward just begun for `key` is its layout's first, run eagerly and untimed (kernels
        compile, workspaces are sized) with the layout undecided, in auto mode: the layer graphs count it as
        their own first sighting (`layer_graphs.GraphedLayer`'s `observe`), so the layout's first graphed
        forward captures rather than running eagerly once more beside the pool other layouts' graphs hold."""
        layout = self.layouts.get(key)
        return self.mode == "auto" and layout is not None and layout.sightings == 1 and layout.decision is None

    def any_graphed(self) -> bool:
        """Whether graphs may still run (a layout decided or still probing graphed)."""
        return self.mode == "on" or self.mode == "auto" and any(
            lay.decision is None or lay.decision.graphed for lay in self.layouts.values())

    # --- Inside -------------------------------------------------------------------------------

    def _way(self, layout: _Layout) -> tuple[bool, bool]:
        """(graphed, timed) for this forward of `layout`."""
        if layout.decision is None:
            self._infer(layout)
        if layout.decision is not None:
            return layout.decision.graphed, layout.watch > 0
        if layout.sightings == 1:
            return False, False  # eager warm-up
        if self._have(layout, False) < self.samples:
            return False, True
        if layout.graph_warm < self.warmup:
            layout.graph_warm += 1
            return True, False
        return True, True

    def _have(self, layout: _Layout, graphed: bool) -> int:
        """Timings of `layout` run `graphed`, recorded or still to be read."""
        waiting = [p for p in self._pending if p[0] is layout and p[1] == graphed]
        running = self._open is not None and self._open[0] is layout and self._open[1] == graphed
        return len(layout.times[graphed]) + len(waiting) + running

    def _settle(self) -> None:
        """Record every pending timing whose end has passed; decide the layouts now timed."""
        still = []
        for layout, graphed, start, end in self._pending:
            seconds = self.clock.seconds(start, end)
            if seconds is None:
                still.append((layout, graphed, start, end))
            elif layout.decision is None:
                layout.times[graphed].append(seconds)
                if min(len(t) for t in layout.times.values()) >= self.samples or self._apart(layout.times):
                    self._decide(layout)
            elif layout.watch and graphed == layout.decision.graphed:
                layout.recent.append(seconds)
                if len(layout.recent) >= layout.watch:
                    self._recheck(layout)
        self._pending = still

    def _apart(self, times: dict[bool, list[float]]) -> bool:
        """Whether each way has a sample and the slower way's fastest is `decisive` times the faster way's slowest
        or more: more samples could not change the answer."""
        graphed, eager = times[True], times[False]
        return bool(graphed and eager) and (max(graphed) * self.decisive <= min(eager)
                                            or max(eager) * self.decisive <= min(graphed))

    def _recheck(self, layout: _Layout) -> None:
        """A watched layout's check: time the other way again where the chosen way's recent
        median is no longer faster than the median the other way lost with."""
        decision, ran = layout.decision, statistics.median(layout.recent)
        assert decision is not None and decision.graphed_s is not None and decision.eager_s is not None
        lost_with = decision.eager_s if decision.graphed else decision.graphed_s
        if ran * (1 + self.margin) < lost_with:
            layout.recent = []  # still the faster way: keep watching
            return
        layout.times = {decision.graphed: layout.recent, not decision.graphed: []}
        layout.recent, layout.decision, layout.graph_warm = [], None, 0
        layout.watch, layout.retimes, layout.retiming = layout.watch * 2, layout.retimes + 1, True

    def _decide(self, layout: _Layout) -> None:
        graphed_s = statistics.median(layout.times[True])
        eager_s = statistics.median(layout.times[False])
        graphed = graphed_s < eager_s * (1 - self.margin)
        faster = "graphed" if graphed else "eager"
        ratio = max(graphed_s, eager_s) / max(min(graphed_s, eager_s), 1e-12)
        n_graphed, n_eager = len(layout.times[True]), len(layout.times[False])
        counted = (f"{self.samples} forwards each way" if n_graphed == n_eager == self.samples else
                   f"{n_graphed} graphed and {n_eager} eager forwards")
        timed = (f"re-timed ({layout.retimes}): the chosen way ran slower than the other had, so {counted}"
                 if layout.retiming else f"timed {counted}")
        if min(n_graphed, n_eager) < self.samples:
            timed += f", {self.decisive:g}x apart or more"
        retimed, layout.retiming, layout.watch = layout.retiming, False, layout.watch or self.watch
        reason = (f"{timed}: graphed {graphed_s * 1e3:.1f} ms, eager {eager_s * 1e3:.1f} ms a step; {faster} " +
                  (f"is {ratio:.2f}x faster" if ratio > 1 + self.margin else "is level, and holds no graph pool"))
        self._set(layout, Decision(layout.name, layout.tokens, graphed, graphed_s, eager_s, reason))
        if retimed:
            self._reinfer()

    def _reinfer(self) -> None:
        """After a re-timed decision: each inferred decision taken again from the timed ones
        (told only where it changed); one that no bound covers any more is probed."""
        for layout in self.layouts.values():
            old = layout.decision
            if old is None or old.graphed_s is not None:
                continue
            new = self._inferred(layout, force=True)
            if new is None:
                layout.decision, layout.sightings = None, 1  # probed afresh from its next forward
                layout.times = {True: [], False: []}
            elif new.graphed != old.graphed:
                self._set(layout, new)

    def _infer(self, layout: _Layout) -> None:
        """Sets the cost model's answer (`_inferred`), where there is one."""
        decision = self._inferred(layout)
        if decision is not None:
            self._set(layout, decision)

    def _inferred(self, layout: _Layout, force: bool = False) -> Decision | None:
        """The cost model's answer, where a timed decision gives one: a layout of as many tokens
        takes its decision at any stage; a bound (fewer tokens than a graphed one, more than an
        eager one) applies before this layout's own timing has started; after, only a graphed one whose
        eager median is `decisive` times its graphed one: the host sets that layout's pace, and more so
        a smaller one's (a decisive eager win is not the cost model's trade: graphs cost a few percent
        where the GPU sets the pace, not half). `force`: whatever its stage and margin, for a layout
        decided by inference before. A layout being re-timed has none."""
        if layout.retiming:
            return None
        timed = [lay.decision for lay in self.layouts.values() if lay.decision is not None and lay.decision.graphed_s is not None]
        same = [d for d in timed if d.tokens == layout.tokens]
        if same:
            return Decision(layout.name, layout.tokens, same[0].graphed, None, None,
                            f"as many tokens as {same[0].layout}, timed")
        if any(g.graphed and not e.graphed and g.tokens >= e.tokens for g in timed for e in timed):
            return None  # the rule does not hold on this run
        bounds = timed
        if layout.sightings > 2 and not force:  # being timed already: only a host-bound layout's bound
            bounds = [d for d in timed if d.graphed and d.eager_s >= self.decisive * d.graphed_s]
        graphed_at = [d.tokens for d in bounds if d.graphed]
        eager_at = [d.tokens for d in bounds if not d.graphed]
        if graphed_at and layout.tokens <= max(graphed_at):
            return Decision(layout.name, layout.tokens, True, None, None,
                            f"no more tokens than a layout timed faster graphed ({max(graphed_at)})")
        if eager_at and layout.tokens >= min(eager_at):
            return Decision(layout.name, layout.tokens, False, None, None,
                            f"no fewer tokens than a layout timed faster eager ({min(eager_at)})")
        return self._graphed_above(layout, timed)

    def _graphed_above(self, layout: _Layout, timed: list[Decision]) -> Decision | None:
        """Graphed, for a layout of n tokens above a timed graphed one of m, where graphs win there by so much that
        they still win `decisive` times over at n: an eager forward takes no less time with more tokens (the same
        launches from the host, more work on the GPU), and a graphed one at most (n / m)^2 times as long (its products
        grow as the tokens, attention at most as their square), so at n graphs win at least R (m / n)^2 times over, R
        their win at m. None where a layout of at most n tokens was timed faster eager (the rule would say eager)."""
        if any(not d.graphed and d.tokens <= layout.tokens for d in timed):
            return None
        below = [(d.eager_s / max(d.graphed_s, 1e-12), d) for d in timed if d.graphed and d.tokens < layout.tokens]
        if not below:
            return None
        ratio, d = max(below, key=lambda rd: rd[0] * rd[1].tokens ** 2)  # the largest bound on the win at n
        win = ratio * (d.tokens / layout.tokens) ** 2
        if win < self.decisive:
            return None
        return Decision(layout.name, layout.tokens, True, None, None,
                        f"graphed {ratio:.1f}x faster at {d.tokens} tokens, so at least {win:.1f}x at "
                        f"{layout.tokens} (graphed time grows at most as the tokens squared)")

    def _set(self, layout: _Layout, decision: Decision) -> None:
        layout.decision = decision
        if self.on_decision is not None:
            self.on_decision(decision)
