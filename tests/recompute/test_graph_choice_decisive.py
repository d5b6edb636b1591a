"""The CUDA-graph choice on decisive evidence (`GraphChooser.decisive`): a layout whose two ways' samples lie
that far apart is decided without the rest of its samples, and a decisively graphed layout bounds smaller
layouts already being timed, so a padded run's interleaved layouts are not each probed to the end. Timing is
a fake clock (`FakeRun`); nothing is timed for real."""

from __future__ import annotations

import pytest

from tests.recompute.test_graph_choice import DroppingRun, FakeRun, host_bound


def test_samples_far_apart_decide_a_layout_at_the_first_graphed_sample() -> None:
    run = FakeRun(host_bound)  # 1,000 tokens: 50 ms eager, 11.2 ms graphed, 4.5x apart
    for _ in range(7):  # an eager warm-up, 3 eager samples, a graphed warm-up (the capture), 2 graphed samples
        run.forward("small", 1000)
    assert not run.decisions  # a forward's time is read two forwards' starts later
    run.forward("small", 1000)
    decision = run.decisions[0]
    assert decision.graphed and decision.graphed_s == pytest.approx(0.0112)
    times = run.chooser.layouts["small"].times
    assert times[True] == pytest.approx([0.0112]) and times[False] == pytest.approx([0.05] * 3)
    assert "1 graphed and 3 eager forwards, 2x apart or more" in decision.reason


def test_samples_closer_than_decisive_are_all_taken() -> None:
    """1.5x apart: within what a busy host's steps were seen to vary by, so the three samples each way are
    taken, whichever way wins."""
    for graphed_s, eager_s in ((0.1, 0.15), (0.15, 0.1)):
        run = FakeRun(lambda tokens, graphed, g=graphed_s, e=eager_s: g if graphed else e)
        for _ in range(9):
            run.forward("k", 1000)
        assert not run.decisions
        for _ in range(2):
            run.forward("k", 1000)
        assert run.decisions[0].graphed == (graphed_s < eager_s)
        assert "3 forwards each way" in run.decisions[0].reason and "apart" not in run.decisions[0].reason


def test_a_noisy_first_sample_is_not_decisive_when_another_sample_overlaps() -> None:
    """Decisive compares the slower way's fastest sample with the faster way's slowest, not their medians: one
    slow eager step among fast ones keeps the layout probing."""
    eager = iter([0.05, 0.012, 0.05] + [0.05] * 20)
    run = FakeRun(lambda tokens, graphed: 0.011 if graphed else next(eager))
    for _ in range(9):
        run.forward("k", 1000)
    assert not run.decisions  # 0.012 eager against 0.011 graphed: not 2x apart
    for _ in range(3):
        run.forward("k", 1000)
    assert run.decisions and run.decisions[0].graphed


def test_a_decisively_graphed_layout_decides_smaller_layouts_being_timed() -> None:
    """Padded rows: four widths taking turns, all host-bound, the widest in every other batch. Once it is decided
    graphed by a wide margin, the narrower ones still probing take its bound instead of finishing their own
    probes; without the bound every layout is probed to the end."""
    widths = [1200, 1600, 800, 1600, 400, 1600]  # the widest is not seen first

    def probes(decisive: float) -> tuple[list[bool], dict[str, object]]:
        run = FakeRun(host_bound, decisive=decisive)
        for i in range(120):
            run.forward(f"w{widths[i % 6]}", widths[i % 6])
        return run.ways, {d.layout: d for d in run.decisions}

    ways, decided = probes(2.0)
    assert len(decided) == 4 and all(d.graphed for d in decided.values())
    inferred = [d for d in decided.values() if d.graphed_s is None]
    assert inferred and all("no more tokens than a layout timed faster graphed" in d.reason for d in inferred)
    assert decided["w1600"].graphed_s is not None  # the widest is timed itself: nothing bounds it
    slow_ways, slow_decided = probes(float("inf"))  # nothing is decisive: the old behaviour
    assert all(d.graphed_s is not None for d in slow_decided.values())
    assert ways.count(False) < slow_ways.count(False)  # fewer eager forwards, each several times slower


def test_a_decisively_eager_layout_does_not_decide_larger_layouts_being_timed() -> None:
    """Graphs twice as slow is not the cost model's trade (graphs cost a few percent where the GPU sets the pace):
    a larger layout already being timed is timed to the end, and here graphs win on it."""
    run = FakeRun(lambda tokens, graphed: (0.1 if graphed else 0.2) if tokens > 5000 else (0.25 if graphed else 0.1))
    for _ in range(14):
        run.forward("small", 1000)
        run.forward("large", 10_000)
    decided = {d.layout: d for d in run.decisions}
    assert not decided["small"].graphed and "apart" in decided["small"].reason
    assert decided["large"].graphed and decided["large"].graphed_s is not None


def test_a_large_graphed_win_decides_somewhat_larger_layouts_too() -> None:
    """Graphs 4.5x faster at 1,000 tokens: at 1,400 they are still at least 4.5 (1000 / 1400)^2 = 2.3x faster (eager
    time does not fall with tokens, graphed time grows at most as their square), so that layout is graphed at its
    first forward, untimed; at 1,600 the bound (1.7x) is not decisive and the layout is probed."""
    run = FakeRun(host_bound)
    for _ in range(10):
        run.forward("k1000", 1000)
    assert run.decisions[0].graphed and run.decisions[0].eager_s / run.decisions[0].graphed_s == pytest.approx(4.46, 0.01)
    assert run.forward("k1400", 1400)  # graphed at its first forward
    inferred = run.decisions[-1]
    assert inferred.layout == "k1400" and inferred.graphed and inferred.graphed_s is None
    assert "at least 2.3x at 1400" in inferred.reason
    assert not run.forward("k1600", 1600)  # eager: its first sighting, then probed
    assert [d.layout for d in run.decisions] == ["k1000", "k1400"]


def test_no_layout_is_graphed_from_below_past_a_layout_timed_faster_eager() -> None:
    """Where a layout between was timed faster eager, the monotone rule says eager above it: no graphed inference
    from below reaches past it, for a layout already being timed (no bound applies to it) as for a new one."""
    run = FakeRun(lambda tokens, graphed: (0.01 if graphed else 0.1) if tokens < 1100 else (0.2 if graphed else 0.1))
    for _ in range(3):
        run.forward("k1200", 1200)  # its first sighting and two eager samples: being timed
    for _ in range(12):
        run.forward("k1000", 1000)
        run.forward("k1100", 1100)
    decided = {d.layout: d.graphed for d in run.decisions}
    assert decided == {"k1000": True, "k1100": False}  # 10x graphed at 1,000 would reach 1,200 (6.9x) but for 1,100
    run.forward("k1200", 1200)
    assert "k1200" not in {d.layout for d in run.decisions}  # still timing itself
    assert not run.forward("k1300", 1300)
    assert run.decisions[-1].layout == "k1300" and "no fewer tokens than a layout timed faster eager" in run.decisions[-1].reason


def test_a_new_layout_decided_graphed_at_once_runs_its_first_forward_alone() -> None:
    """The cost model graphs a new layout at its first forward, but the layer graphs capture a signature only at its
    second sighting: that first forward runs eagerly, so the caller drops the graphs first (`runs_alone`), as for an
    undecided layout's eager forwards; its later forwards replay beside the others' graphs."""
    run = DroppingRun(host_bound, capture=0.0)
    for _ in range(10):
        run.forward("k1000", 1000)
    assert run.chooser.decided_graphed("k1000") and run.held == {"k1000"}
    drops = run.drops
    for tokens in (800, 1400):  # below (the bound) and above (the large win) the timed layout
        assert run.forward(f"k{tokens}", tokens) and run.alone[-1]
        assert run.drops == drops + 1
        drops = run.drops
        run.forward("k1000", 1000)
        assert run.forward(f"k{tokens}", tokens) and not run.alone[-1] and run.drops == drops
