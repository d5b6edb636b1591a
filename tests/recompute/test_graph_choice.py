"""The CUDA-graph choice (`kestrel.recompute.graph_choice`): it keeps the faster of two timed ways per batch
layout, remembers it, decides a new layout anew, infers by the stated cost model only where a
timed decision bounds it, and never times in forced modes. Timing here is a fake clock that
advances by what each way costs; nothing is timed for real."""

from __future__ import annotations

import pytest

from kestrel.config import config_from_dict
from kestrel.recompute.graph_choice import GraphChooser, WallClock


class FakeRun:
    """Forwards whose duration depends on the way they run: `cost(tokens, graphed)` seconds."""

    def __init__(self, cost, **kwargs) -> None:
        self.now = 0.0
        self.cost = cost
        self.decisions = []
        self.chooser = GraphChooser("auto", WallClock(lambda: self.now), on_decision=self.decisions.append, **kwargs)
        self.ways: list[bool] = []

    def forward(self, key, tokens: int) -> bool:
        graphed = self.chooser.begin(key, tokens)
        self.ways.append(graphed)
        self.now += self.cost(tokens, graphed)
        return graphed


def host_bound(tokens: int, graphed: bool) -> float:
    """Small layouts wait on the host (graphs win); large ones on the GPU (graphs cost 2%)."""
    gpu = tokens * 1e-5
    return max(gpu, 0.05) if not graphed else gpu * 1.02 + 0.001


def test_keeps_the_faster_way_of_each_layout_and_remembers_it() -> None:
    run = FakeRun(host_bound)
    for _ in range(14):
        run.forward("small", 1000)  # host-bound: 50 ms eager, 11 ms graphed
    assert [d.layout for d in run.decisions] == ["small"] and run.decisions[0].graphed
    assert run.decisions[0].graphed_s == pytest.approx(0.0112) and run.decisions[0].eager_s == pytest.approx(0.05)
    assert "graphed" in run.decisions[0].reason and "faster" in run.decisions[0].reason
    # Eager first (a warm-up, then 3 timed), then graphed (3 warm-up: the graphs' eager sighting
    # and two captures; then 3 timed).
    assert run.ways[:10] == [False] * 4 + [True] * 6
    assert all(run.ways[10:])  # decided: graphed from then on
    for _ in range(14):
        run.forward("large", 100_000)  # GPU-bound: 1.0 s eager, 1.02 s graphed
    large = run.decisions[1]
    assert large.layout == "large" and not large.graphed and large.eager_s < large.graphed_s
    assert not any(run.ways[-2:])
    assert run.forward("small", 1000)  # the first layout's choice still holds


def test_a_tie_goes_to_eager() -> None:
    run = FakeRun(lambda tokens, graphed: 0.1 * (0.997 if graphed else 1.0))
    for _ in range(14):
        run.forward("k", 10)
    assert run.decisions and not run.decisions[0].graphed  # 0.3% faster is within the 1% margin
    assert "level" in run.decisions[0].reason


def test_the_cost_model_infers_only_inside_timed_bounds() -> None:
    run = FakeRun(host_bound)
    for _ in range(14):
        run.forward(2000, 2000)
        run.forward(90_000, 90_000)
    timed = {d.tokens: d for d in run.decisions}
    assert timed[2000].graphed and not timed[90_000].graphed
    run.forward(1500, 1500)  # fewer tokens than a layout timed faster graphed: graphed, untimed
    run.forward(120_000, 120_000)  # more than one timed faster eager: eager, untimed
    inferred = {d.tokens: d for d in run.decisions[2:]}
    assert inferred[1500].graphed and inferred[1500].graphed_s is None
    assert not inferred[120_000].graphed and "90000" in inferred[120_000].reason
    run.forward(30_000, 30_000)  # between the bounds: probed
    assert 30_000 not in {d.tokens for d in run.decisions}
    for _ in range(14):
        run.forward(30_000, 30_000)
    assert {d.tokens: d for d in run.decisions}[30_000].graphed_s is not None


def test_when_the_rule_does_not_hold_every_layout_is_timed() -> None:
    # Graphs pay on the large layout and not on the small one: the monotone rule is off.
    run = FakeRun(lambda tokens, graphed: (0.1 if graphed else 0.2) if tokens > 5000 else (0.2 if graphed else 0.1))
    for _ in range(14):
        run.forward("small", 1000)
        run.forward("large", 10_000)
    assert not run.decisions[0].graphed and run.decisions[1].graphed
    run.forward("mid", 3000)
    run.forward("tiny", 10)
    assert len(run.decisions) == 2  # neither inferred


def test_timings_wait_until_the_device_has_passed_them() -> None:
    class LaggingClock:
        """Marks are read only two forwards later, as CUDA events are once passed."""

        def __init__(self) -> None:
            self.t, self.marks = 0.0, 0

        def mark(self) -> tuple[int, float]:
            self.marks += 1
            return self.marks, self.t

        def seconds(self, start, end):
            return end[1] - start[1] if self.marks - end[0] >= 2 else None

        def drain(self) -> None:
            pass

    clock = LaggingClock()
    chooser = GraphChooser("auto", clock, warmup=3, decisive=float("inf"))  # every sample taken: a long probe
    ways = []
    for i in range(11):
        ways.append(chooser.begin("k", 100))
        clock.t += 0.01 if ways[-1] else 0.03
    assert chooser.decisions() == []  # the last probes' ends have not been read yet
    assert ways.count(True) > 6  # graphed forwards go on until their timings are read
    for _ in range(3):
        chooser.begin("k", 100)
        clock.t += 0.01
    assert chooser.decisions()[0].graphed


@pytest.mark.parametrize("mode", ["on", "off"])
def test_forced_modes_never_time(mode: str) -> None:
    class NoClock:
        def mark(self):
            raise AssertionError("a forced mode timed a forward")

    chooser = GraphChooser(mode, NoClock())  # type: ignore[arg-type]
    assert all(chooser.begin(("k", i), 10) == (mode == "on") for i in range(20))
    assert chooser.decisions() == []


def test_the_mode_is_saved_with_the_run() -> None:
    # The rest of the switch (default, checks, the variable): tests/recompute/test_performance_switches.py.
    config = config_from_dict({"performance": {"cuda_graphs": "off"}})
    assert "cuda_graphs: 'off'" in config.to_yaml() or "cuda_graphs: off" in config.to_yaml()


def test_a_layout_of_as_many_tokens_takes_the_timed_decision_even_mid_probe() -> None:
    """The same batch with another number of samples (another cu_seqlens capacity) is another
    layout of the same work: it stops probing once one of them is decided."""
    run = FakeRun(host_bound)
    for i in range(14):
        run.forward(("packed", 16), 4096)
        if i == 4:
            run.forward(("packed", 64), 4096)  # seen once, early: in its eager warm-up
    run.forward(("packed", 64), 4096)
    decided = {d.layout: d for d in run.decisions}
    assert decided["('packed', 16)"].graphed_s is not None
    assert decided["('packed', 64)"].graphed and decided["('packed', 64)"].graphed_s is None


def test_a_no_grad_forward_follows_only_a_decided_layout_and_times_nothing() -> None:
    run = FakeRun(host_bound)
    assert not run.chooser.decided_graphed("small")  # never seen
    for _ in range(6):
        run.forward("small", 1000)  # still timing
        assert not run.chooser.decided_graphed("small")
    for _ in range(8):
        run.forward("small", 1000)
    assert run.decisions[0].graphed and run.chooser.decided_graphed("small")
    for _ in range(14):
        run.forward("large", 100_000)
    assert not run.decisions[1].graphed and not run.chooser.decided_graphed("large")
    layouts = dict(run.chooser.layouts)
    assert not run.chooser.decided_graphed("other")
    assert run.chooser.layouts == layouts  # nothing recorded for the asked layout
    assert GraphChooser("on").decided_graphed("x") and not GraphChooser("off").decided_graphed("x")


def test_graphs_are_kept_once_a_layout_is_decided_graphed_not_while_timing() -> None:
    run = FakeRun(host_bound)
    for _ in range(6):
        run.forward("small", 1000)
    assert run.chooser.any_graphed() and not run.chooser.graphs_kept()  # still timing
    for _ in range(8):
        run.forward("small", 1000)
    assert run.chooser.graphs_kept()
    eager = FakeRun(lambda tokens, graphed: 1.0 if graphed else 0.5)
    for _ in range(14):
        eager.forward("k", 10)
    assert not eager.chooser.graphs_kept() and not eager.chooser.any_graphed()
    assert GraphChooser("on").graphs_kept() and not GraphChooser("off").graphs_kept()


def test_interleaved_layouts_are_all_decided() -> None:
    """Layouts that take turns (a, b, a, c, ...: padded rows of several widths) make the ways
    alternate from one forward to the next while they are probed; each forward is still timed
    (the device is drained at a switch), so every layout is decided, each the right way."""
    run = FakeRun(host_bound)
    order = [("a", 800), ("b", 1600), ("a", 800), ("c", 200_000)]
    for i in range(160):
        run.forward(*order[i % len(order)])
    decided = {d.layout: d.graphed for d in run.decisions}
    assert decided == {"a": True, "b": True, "c": False}
    assert all(run.ways[-8:][i] == (order[i % 4][0] != "c") for i in range(8))  # each follows its decision


# --- watched decisions ---------------------------------------------------------------------------


def test_a_choice_whose_way_runs_slower_than_the_other_had_is_timed_again_and_undone() -> None:
    """The eager probe met three lucky steps (0.38 s) and won against graphed (0.39 s); eager steps
    then run at 0.48 s. After `watch` eager forwards the chooser times graphed again, against the
    eager steps' recent median, and switches (DPO on an H200, session 33: 0.48 against 0.39 s)."""
    eager_seen = []

    def cost(tokens: int, graphed: bool) -> float:
        if graphed:
            return 0.39
        eager_seen.append(1)
        return 0.38 if len(eager_seen) <= 4 else 0.48

    run = FakeRun(cost)
    for _ in range(10 + 12 + 6 + 40):
        run.forward("k", 3328)
    first, second = run.decisions
    assert not first.graphed and first.eager_s == pytest.approx(0.38)
    assert second.graphed and second.eager_s == pytest.approx(0.48) and second.graphed_s == pytest.approx(0.39)
    assert "re-timed (1)" in second.reason and "3 graphed and 1" in second.reason  # 12 or 13 eager: the watch's
    decided = run.ways.index(False, 7)  # the first forward after the probe (timings are read a forward late)
    assert run.ways[decided:decided + 12] == [False] * 12  # watched: the decided way ran its window
    assert all(run.ways[-40:]) and run.chooser.decided_graphed("k")


def test_a_choice_that_holds_is_never_timed_again() -> None:
    run = FakeRun(host_bound)
    for _ in range(500):
        run.forward("small", 1000)
    assert len(run.decisions) == 1 and all(run.ways[10:])
    assert run.chooser.layouts["small"].retimes == 0


def test_drift_that_slows_both_ways_re_times_a_layout_only_log_often_and_keeps_the_choice() -> None:
    """Every forward after the decision is 30% slower whichever way (a GPU slowing under power):
    the chosen way's median passes the other's old one, so the other is timed again, is slower
    still, and the choice stands; the window doubles each time, so over 600 forwards the layout is
    re-timed at most log2(600 / 12) + 1 times."""
    count = [0]

    def cost(tokens: int, graphed: bool) -> float:
        count[0] += 1
        slow = 1.3 if count[0] > 10 else 1.0
        return (0.1 if graphed else 0.12) * slow

    run = FakeRun(cost)
    for _ in range(600):
        run.forward("k", 100)
    layout = run.chooser.layouts["k"]
    assert 1 <= layout.retimes <= 6
    assert all(d.graphed for d in run.decisions) and len(run.decisions) == layout.retimes + 1
    assert run.ways.count(False) <= 4 + 3 * layout.retimes  # the probes' eager forwards, no more


def test_decisions_inferred_from_an_undone_one_are_inferred_again() -> None:
    """A small layout decided eager (its eager probe met fast steps) makes a larger one eager by
    inference; once the small one is re-timed graphed, the larger one has no bound left and is
    probed on its own."""
    eager_seen = []

    def cost(tokens: int, graphed: bool) -> float:
        if tokens == 4000:
            return 0.2 if graphed else 0.1  # the large layout: eager really is faster
        if graphed:
            return 0.2
        eager_seen.append(1)
        return 0.1 if len(eager_seen) <= 4 else 0.3

    run = FakeRun(cost)
    for _ in range(12):
        run.forward("small", 1000)
    run.forward("large", 4000)
    assert [d.graphed for d in run.decisions] == [False, False] and run.decisions[1].eager_s is None
    for _ in range(12 + 8):
        run.forward("small", 1000)
    assert run.decisions[-1].graphed and "re-timed" in run.decisions[-1].reason
    assert not run.chooser.decided_graphed("large") and run.chooser.layouts["large"].decision is None
    for _ in range(12):
        run.forward("large", 4000)
    large = run.decisions[-1]
    assert large.layout == "large" and not large.graphed and large.eager_s == pytest.approx(0.1)


def test_a_re_timing_that_keeps_the_choice_tells_no_inferred_decision_again() -> None:
    """Drift re-times the timed layout and the choice stands: the layout inferred from it keeps
    its decision, and the log hears of it once."""
    count = [0]

    def cost(tokens: int, graphed: bool) -> float:
        count[0] += 1
        return (0.1 if graphed else 0.12) * (1.3 if count[0] > 11 else 1.0)

    run = FakeRun(cost)
    for _ in range(11):
        run.forward("small", 1000)
    run.forward("tiny", 10)  # inferred graphed: fewer tokens than a layout timed faster graphed
    for _ in range(60):
        run.forward("small", 1000)
    assert run.chooser.layouts["small"].retimes >= 1
    assert [d.layout for d in run.decisions].count("tiny") == 1 and run.chooser.decided_graphed("tiny")


def test_a_spoiled_forward_is_not_counted_and_the_next_starts_drained() -> None:
    # The forward that times a layer's first pass behind a lead (`FirstPassTimes`) holds its stream idle:
    # its time would make the eager way look slow, so it is left out and sampled again.
    drains: list[int] = []

    class Clock(WallClock):
        def drain(self) -> None:
            drains.append(len(run.ways))

    run = FakeRun(host_bound)
    run.chooser.clock = Clock(lambda: run.now)
    run.forward("k", 1000)  # eager warm-up
    run.forward("k", 1000)  # eager, timed...
    run.chooser.spoil()  # ...but spoiled
    run.now += 5.0  # the lead: it would have made eager lose by far
    assert drains == []
    for _ in range(12):
        run.forward("k", 1000)
    assert drains[0] == 2  # the forward after the spoiled one began on a drained device
    decision = run.decisions[0]
    assert decision.eager_s == pytest.approx(0.05)  # three clean eager samples; the spoiled one is not among them
    assert run.ways[:5] == [False, False, False, False, False]  # one eager forward more to make up for it


class DroppingRun(FakeRun):
    """A caller as `Recompute` is: it drops its graphs before every forward `runs_alone` names, pays `capture`
    seconds in each graphed forward that captures them again (what a real recapture costs), and leaves such a
    forward's time out (`spoil`, at the next forward's start)."""

    def __init__(self, cost, capture: float = 1.0, **kwargs) -> None:
        super().__init__(cost, **kwargs)
        self.capture, self.held, self.drops, self.captured = capture, set(), 0, False
        self.alone: list[bool] = []

    def forward(self, key, tokens: int) -> bool:
        if self.captured:
            self.chooser.spoil()
        graphed = self.chooser.begin(key, tokens)
        alone = self.chooser.runs_alone(key)
        self.alone.append(alone)
        if alone and self.held:
            self.held.clear()
            self.drops += 1
            self.now += 0.5  # the collection pass and the emptied cache: not the forward's
            self.chooser.restart()
        self.ways.append(graphed)
        self.captured = graphed and key not in self.held
        if self.captured:
            self.held.add(key)
            self.now += self.capture
        self.now += self.cost(tokens, graphed)
        return graphed


def test_an_undecided_layouts_eager_forwards_run_alone_and_every_graph_dropped_for_them() -> None:
    """`runs_alone`: a new layout's first sighting and eager probes, while another layout replays graphs; the
    caller drops the graphs first, and neither the drop's cost nor the recaptures that follow count in either
    way's times, so both layouts are decided as they would be alone."""
    run = DroppingRun(host_bound, watch=4)  # a window the four recaptures would fill, were they timed
    for _ in range(14):
        run.forward("small", 1000)
    assert run.chooser.decided_graphed("small") and run.held == {"small"} and run.drops == 0
    assert run.alone[:4] == [True] * 4 and not any(run.alone[4:])  # its eager forwards: nothing held yet
    for _ in range(30):  # a new, larger layout taking turns with the graphed one
        run.forward("new", 3000)
        run.forward("small", 1000)
    new_forwards = run.alone[14::2]
    assert new_forwards[:4] == [True] * 4 and not any(new_forwards[4:])  # first sighting + 3 eager samples
    assert run.drops == 4 and not any(run.alone[15::2])  # a decided layout's forwards never drop anything
    decisions = {d.layout: d for d in run.decisions}
    assert decisions["new"].graphed and decisions["new"].eager_s == pytest.approx(0.05)
    assert decisions["new"].graphed_s == pytest.approx(host_bound(3000, True))  # no capture counted in it
    assert decisions["small"].graphed_s == pytest.approx(host_bound(1000, True))
    assert [d.layout for d in run.decisions] == ["small", "new"]  # the recaptures did not re-time "small"
    for mode in ("on", "off"):
        forced = GraphChooser(mode)
        forced.begin("a", 1000)
        assert not forced.runs_alone("a")
    assert not run.chooser.runs_alone("never seen")


def test_a_graphed_choice_is_re_timed_eagerly_with_its_graphs_dropped() -> None:
    """Graphed steps slow down past the eager time the choice beat: the eager way is timed again, its three
    forwards each with the graphs dropped (`runs_alone`), so its working set is never reserved beside them."""
    slow = {"on": False}

    def cost(tokens: int, graphed: bool) -> float:
        return (0.2 if slow["on"] else 0.011) if graphed else 0.05

    run = DroppingRun(cost, capture=0.0)
    for _ in range(14):
        run.forward("k", 1000)
    assert run.chooser.decided_graphed("k") and not run.chooser.runs_alone("k")
    slow["on"] = True
    for _ in range(28):  # the watch window's check falls in these whatever forward the choice was made at
        run.forward("k", 1000)
    alone = run.alone[-28:]
    # The re-timing's first eager sample decides it (4x the graphed way's recent steps); a time is read two forwards'
    # starts later, so one more eager forward ran meanwhile
    assert alone.count(True) == 2
    assert all(not w for a, w in zip(alone, run.ways[-28:]) if a)  # ...run eagerly
    assert run.drops == 1
    assert not run.chooser.decided_graphed("k")  # eager now: 0.05 against 0.2 s


def test_restart_times_the_forward_just_begun_from_now() -> None:
    """`restart`: the forward just begun is timed from now, not from before the work its caller did first (a
    drop of the graphs: a collection pass, the allocator's cache emptied)."""
    probe = FakeRun(lambda tokens, graphed: 0.011 if graphed else 0.05)
    probe.chooser.begin("a", 10)
    probe.now += 0.05
    probe.chooser.begin("a", 10)  # timed: the first eager sample
    probe.now += 7.0  # work the caller did that is not the forward's
    probe.chooser.restart()
    probe.now += 0.05
    probe.chooser.begin("a", 10)
    probe.chooser.begin("a", 10)  # timings are read at the next forward's start
    assert probe.chooser.layouts["a"].times[False][0] == pytest.approx(0.05)


def test_only_an_undecided_layouts_first_forward_is_its_first_sighting() -> None:
    """`first_sighting`: the forward just begun is a new layout's eager, untimed first (the layer graphs count
    it as theirs); not its later forwards, not a layout the cost model decides at its first forward, and never
    with graphs forced."""
    run = FakeRun(host_bound)
    run.forward("a", 2000)
    assert run.chooser.first_sighting("a") and not run.ways[-1]
    run.forward("a", 2000)
    assert not run.chooser.first_sighting("a")
    for _ in range(12):
        run.forward("a", 2000)
    assert run.decisions and run.decisions[0].graphed
    run.forward("b", 1500)  # inferred graphed at its first forward: not an eager sighting
    assert run.ways[-1] and not run.chooser.first_sighting("b")
    assert not run.chooser.first_sighting("never seen")
    for mode in ("on", "off"):
        forced = GraphChooser(mode)
        forced.begin("a", 2000)
        assert not forced.first_sighting("a")
