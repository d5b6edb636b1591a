"""kestrel.recompute.host_link: whether a layer's pages end within its first pass, and who asks."""

from __future__ import annotations

import pytest
import torch

from kestrel.model.kept_attention import KeptBytes, Keeping

from kestrel.recompute.host_link import FirstPassTimes, HostLink, measure_link_rate

GPU = torch.device("cuda", 0)  # the link only keys its rates by device


@pytest.mark.parametrize("rate", [12e9, 55e9, 450e9])  # PCIe 3 and 5, a chip-to-chip link
def test_a_layer_keeps_up_while_its_pages_end_within_its_first_pass(rate: float) -> None:
    link = HostLink(lambda d: rate)
    rows, per_row = 6144, 3 * 1664  # no model's: 6,144 rows of 4,992 bytes
    assert link.keeps_up(rows, per_row, GPU)[0] is None  # untimed
    link.record(rows, rows * per_row / rate)
    fits, why = link.keeps_up(rows, per_row, GPU)
    assert fits and "within" in why and f"{rate / 1e9:.1f} GB/s" in why
    fits, why = link.keeps_up(rows, per_row + 2, GPU)
    assert fits is False and "longer than" in why


def test_the_rate_is_measured_once_a_device_and_none_keeps_nothing() -> None:
    asked: list[torch.device] = []
    link = HostLink(lambda d: asked.append(d) or 50e9)
    link.record(100, 1.0)
    link.record(200, 1.0)
    link.keeps_up(100, 10, GPU)
    link.keeps_up(200, 10, GPU)
    assert asked == [GPU]
    unmeasured = HostLink(lambda d: None)
    unmeasured.record(100, 1.0)
    assert unmeasured.keeps_up(100, 10, GPU) == (False, "the host link's rate could not be measured")


def test_no_rate_off_cuda() -> None:
    assert measure_link_rate(torch.device("cpu")) is None


@pytest.mark.gpu
def test_the_rate_is_a_plausible_host_link_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rate = measure_link_rate(torch.device("cuda"))
    assert rate is not None and 1e9 < rate < 2e12  # between a slow PCIe link and beyond NVLink-C2C


@pytest.mark.parametrize("rate, kept", [(1e15, True), (1.0, False)])
def test_auto_keeps_attention_only_once_timed_and_where_the_link_keeps_up(
    rate: float, kept: bool, tiny_model_dir, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # keep_attention auto, rows of 160 >= the tiny hidden size (128): nothing is kept until the row
    # count's first pass is timed (its second forward; handed over at the third); from then on a fast
    # link keeps each layer's output (one reference forward a layer in the first pass, its backward in
    # the recompute), a slow one never.
    from kestrel.config import LoraSettings
    from kestrel.kernels.lora import mlp as mlp_module
    from kestrel.model import kept_attention as kept_module
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora
    from kestrel.recompute import checkpoint
    from kestrel.recompute.mlp_deferral import MLPDeferral

    class Timed(MLPDeferral):  # asks on the CPU as it would on CUDA
        def wants_layer_time(self, rows: int, device: torch.device) -> bool:
            return super().wants_layer_time(rows, GPU)

    calls = {"forward": 0, "backward": 0}

    def count(name, fn):
        def counted(*a):
            calls[name] += 1
            return fn(*a)
        return counted

    monkeypatch.setattr(kept_module, "REFERENCE_CAUSAL", kept_module.CausalKernels(
        count("forward", kept_module.reference_forward), count("backward", kept_module.reference_backward)))
    monkeypatch.setattr(mlp_module, "DEFERRED_ROWS", 8)
    monkeypatch.delenv("KESTREL_KEEP_ATTENTION", raising=False)
    folder = tiny_model_dir("llama")
    policy = Timed("fit", headroom=lambda d: 1 << 36, host_room=lambda: 1 << 36, link_rate=lambda d: rate)
    torch.manual_seed(0)
    model, _ = load(str(folder), 64, dtype="fp32", device="cpu")
    model = attach_lora(model, LoraSettings(r=8, alpha=16))
    heard: list[tuple[int, bool]] = []
    checkpoint.set_gradient_checkpointing(model, "offload", "off", deferral=policy, keep_attention="auto",
                                          on_attention=lambda rows, kept, why: heard.append((rows, kept)))
    model.train()
    ids = torch.randint(5, 200, (1, 160), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the first forward compiles (untimed), the second is timed, handed over at the third
        model(input_ids=ids, labels=ids).loss.backward()
    assert calls == {"forward": 0, "backward": 0} and not policy.link.timed(160)
    model(input_ids=ids, labels=ids).loss.backward()
    assert policy.link.timed(160)
    layers = 2
    assert calls == ({"forward": layers, "backward": layers} if kept else {"forward": 0, "backward": 0}), calls
    assert heard == [(160, kept)]  # once, though every layer asked


def test_auto_answers_reach_the_log_and_performance_json(tmp_path) -> None:
    import json
    from types import SimpleNamespace

    from kestrel.training.recipe import PerformanceRecord, attention_reporter

    lines: list[str] = []
    report = attention_reporter(PerformanceRecord(tmp_path), SimpleNamespace(on_log=lines.append))  # type: ignore[arg-type]
    report(8192, True, "paging 96 MiB a layer takes 1.9 ms at 50.0 GB/s, within its first pass (2.40 ms)")
    report(4096, False, "paging 48 MiB a layer takes 0.96 ms at 50.0 GB/s, longer than its first pass (0.80 ms)")
    made = json.loads((tmp_path / "performance.json").read_text())["keep_attention"]
    assert [(m["rows"], m["kept"]) for m in made] == [(8192, True), (4096, False)]
    assert "8192 rows: kept" in lines[0] and "4096 rows: recomputed" in lines[1] and "longer than" in lines[1]


class _Timeline:
    """A device timeline the tests move by hand: marks are (index, time) and read once `passed`."""

    def __init__(self) -> None:
        self.t, self.marks, self.passed = 0.0, 0, True

    def mark(self) -> tuple[int, float]:
        self.marks += 1
        return self.marks, self.t

    def seconds(self, start, end):
        return end[1] - start[1] if self.passed else None


def _timer(host_per_pass: float, tries: int = 3) -> tuple[FirstPassTimes, _Timeline, list[int]]:
    """Times on a device of 2e9 cycles a second, passes of 1 ms on it, each enqueued in `host_per_pass`
    seconds of the host's."""
    gpu, host, spins = _Timeline(), [0.0], []

    def spin(cycles: int) -> None:
        spins.append(cycles)
        gpu.t += cycles / 2e9

    timer = FirstPassTimes(gpu, tries=tries, lead_cycles=2_000_000, spin=spin, host_clock=lambda: host[0])

    def run_pass(rows: int) -> None:
        timer.start(rows, cuda=True)
        host[0] += host_per_pass
        gpu.t += 1e-3
        timer.stop(rows)

    timer.run_pass = run_pass  # type: ignore[attr-defined]
    return timer, gpu, spins


def test_a_pass_enqueued_within_its_lead_counts_once_the_device_has_passed_it() -> None:
    timer, gpu, spins = _timer(host_per_pass=0.5e-3)  # the host enqueues in 0.5 ms, under the 1 ms lead
    timer.run_pass(8192)  # type: ignore[attr-defined]
    assert spins == [2_000_000] and timer.timing(8192)
    gpu.passed = False
    assert list(timer.finished()) == [] and timer.timing(8192)  # not read before the device gets there
    gpu.passed = True
    assert list(timer.finished()) == [(8192, pytest.approx(1e-3))] and not timer.timing(8192)
    assert timer.cycles_per_s == pytest.approx(2e9)


def test_a_pass_the_host_held_up_is_timed_again_with_a_lead_twice_the_hosts_time() -> None:
    timer, gpu, spins = _timer(host_per_pass=3e-3)  # 3 ms of the host's against a 1 ms lead
    timer.run_pass(4096)  # type: ignore[attr-defined]
    assert list(timer.finished()) == [] and not timer.timing(4096)  # dropped: to be timed again
    timer.run_pass(4096)  # type: ignore[attr-defined]
    assert spins[1] == pytest.approx(2 * 3e-3 * 2e9, rel=1e-6)  # 6 ms of the device's clock
    assert list(timer.finished()) == [(4096, pytest.approx(1e-3))]


def test_after_its_tries_a_held_up_pass_counts_as_it_is() -> None:
    timer, gpu, spins = _timer(host_per_pass=3e-3, tries=2)
    timer.leads[512] = 1  # a lead that never covers the host
    for _ in range(2):
        timer.run_pass(512)  # type: ignore[attr-defined]
        got = list(timer.finished())
        timer.leads[512] = 1
    assert got == [(512, pytest.approx(1e-3))] and len(spins) == 2


def test_off_cuda_there_is_no_lead_and_the_clocks_time_counts() -> None:
    timer, gpu, spins = _timer(host_per_pass=5.0)
    timer.start(64, cuda=False)
    gpu.t += 2e-3
    timer.stop(64)
    assert spins == [] and list(timer.finished()) == [(64, pytest.approx(2e-3))]


@pytest.mark.gpu
def test_a_led_pass_on_cuda_times_the_device_without_the_hosts_gaps() -> None:
    # 400 one-element additions: the host takes longer to launch each than the GPU to run it, so an
    # eager timing is the host's; behind a lead the GPU runs them back to back.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kestrel.recompute.graph_choice import CudaClock

    x = torch.zeros(1, device="cuda")

    def launches() -> None:
        for _ in range(400):
            x.add_(1)

    launches()
    clock = CudaClock()
    start = clock.mark()
    launches()
    end = clock.mark()
    torch.cuda.synchronize()
    eager = clock.seconds(start, end)
    timer = FirstPassTimes(clock)
    for _ in range(timer.tries):
        timer.start(1, cuda=True)
        launches()
        timer.stop(1)
        torch.cuda.synchronize()
        got = dict(timer.finished())
        if got:
            break
    assert got and got[1] < eager, (got, eager)


def _recompute(host_room: int | None, layers: int = 20, link: float = 50e9, projection: int = 0, qkv: int = 0):
    """A run's `Recompute` (offload, graphs off) over `layers` stand-in layers, `memory` deferral, the
    attention output 1,040 bytes a row (and the output projection's `projection` bytes and Q, K and V's `qkv`
    bytes, each kept where nonzero), a host link of `link` bytes/s, `host_room` bytes of host memory."""
    from kestrel.recompute.checkpoint import Recompute
    from kestrel.recompute.graph_choice import GraphChooser
    from kestrel.recompute.mlp_deferral import MLPDeferral

    deferral = MLPDeferral("memory", host_room=lambda: host_room, link_rate=lambda d: link)
    run = Recompute(True, None, GraphChooser("off"), deferral=deferral, keep_attention="auto",
                    keep_projection=projection > 0, keep_qkv=qkv > 0)
    run.kept_sizes = KeptBytes(1040, projection, qkv)
    deferral.kept_bytes = run.kept_bytes_at
    stand_ins = [torch.nn.Linear(1, 1) for _ in range(layers)]
    for layer in stand_ins:
        run._layers.add(layer)
    run.stand_ins = stand_ins  # type: ignore[attr-defined]  # the weak set's members live as long as the run
    return run


def test_auto_counts_the_gate_products_of_mlps_that_keep_whole_rows_at_that_row_count() -> None:
    # 3,000 rows of hidden 1,024: input 2,048 + output 1,040 bytes a row pass a link that a paged E (I 5,632)
    # would overrun; only the MLPs' answers at that row count count.
    from kestrel.recompute.mlp_deferral import DeferDecision

    run = _recompute(host_room=1 << 40)
    rows, hidden = 3000, 1024
    run.deferral.link.record(rows, rows * (hidden * 2 + 1040 + 100) / 50e9)  # room for input and output only
    run.deferral.paged_layers = 20
    run.deferral.decided[(rows, 5632, hidden, 0, GPU)] = DeferDecision(rows, 5632, deferred=True, reason="")
    run.deferral.decided[(4096, 5632, hidden, 0, GPU)] = DeferDecision(4096, 5632, deferred=False, reason="")
    assert run.attention_keeps_up(rows, hidden, GPU) is True
    again = _recompute(host_room=1 << 40)
    again.deferral.link.record(rows, rows * (hidden * 2 + 1040 + 100) / 50e9)
    again.deferral.paged_layers = 20
    again.deferral.decided[(rows, 5632, hidden, 0, GPU)] = DeferDecision(rows, 5632, deferred=False, reason="")
    assert again.attention_keeps_up(rows, hidden, GPU) is False


def test_auto_keeps_nothing_where_the_pages_would_pin_over_half_the_host() -> None:
    rows, hidden = 8192, 1024
    pages = 20 * rows * (hidden * 2 + 1040)  # every layer's input and output
    heard: list[tuple[int, bool, str]] = []
    for host, kept in ((2 * pages, True), (2 * pages - 1, False), (None, False)):
        run = _recompute(host_room=host)
        run.on_attention = lambda r, k, why: heard.append((r, k, why))
        run.deferral.link.record(rows, 1.0)  # a slow layer: the link keeps up
        assert run.attention_keeps_up(rows, hidden, GPU) is kept
    assert "pin" in heard[1][2] and "GiB of host memory" in heard[1][2] and "unknown" in heard[2][2]


def test_only_row_counts_asked_about_are_timed_for_auto() -> None:
    run = _recompute(host_room=1 << 40)
    reads: list[int] = []
    run.deferral.host_room = lambda: reads.append(1) or 1 << 40
    assert not run._wants_layer_time(8192, GPU)  # no layer asked: short rows, or nothing to keep
    assert run.attention_keeps_up(8192, 1024, GPU) is False  # untimed: nothing kept yet
    assert reads == []  # every layer asks while untimed: the host's memory is read only once the link answers
    assert run._wants_layer_time(8192, GPU) and not run._wants_layer_time(8192, torch.device("cpu"))
    assert not run._wants_layer_time(4096, GPU)
    run.deferral.link.record(8192, 1.0)
    assert not run._wants_layer_time(8192, GPU)


def test_without_a_spin_kernel_a_pass_is_timed_as_it_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    # A torch without `torch.cuda._sleep`: no lead, and the clock's time counts (launch gaps and all).
    monkeypatch.delattr(torch.cuda, "_sleep", raising=False)
    gpu, host = _Timeline(), [0.0]
    timer = FirstPassTimes(gpu, host_clock=lambda: host[0])
    assert timer.spin is None
    timer.start(8192, cuda=True)
    gpu.t, host[0] = 3e-3, 5e-3
    timer.stop(8192)
    assert list(timer.finished()) == [(8192, pytest.approx(3e-3))]


def test_auto_keeps_the_extras_only_where_the_link_has_room_for_them_too() -> None:
    # 8,192 rows of hidden 1,024: input 2,048 + attention 1,040 bytes a row, then the projection's 2,048, then
    # Q, K and V's 3,072: each level is kept where a first pass of that many bytes a row carries them.
    rows, hidden = 8192, 1024
    heard: list[tuple[int, bool, str]] = []
    cases = ((2048 + 1040 + 2048 + 3072, True, True, True), (2048 + 1040 + 2048, True, True, False),
             (2048 + 1040, True, False, False), (2048, False, False, False))
    for room, kept, projection, qkv in cases:
        run = _recompute(host_room=1 << 40, projection=2048, qkv=3072)
        run.on_attention = lambda r, k, why: heard.append((r, k, why))
        run.deferral.link.record(rows, rows * (room + 10) / 50e9)
        stand_in = torch.empty(1, rows, hidden, device="meta")
        assert run.extras_at(stand_in) == Keeping()  # no layer asked at this row count: nothing kept
        assert run.attention_keeps_up(rows, hidden, GPU) is kept
        assert run.extras_at(stand_in) == Keeping(kept, projection, qkv)
        assert run.kept_bytes_at(rows) == kept * 1040 + projection * 2048 + qkv * 3072
    assert heard[0][2].startswith("the attention output, the output projection's output, Q, K and V: ")
    assert heard[1][2].count("; ") == 1 and heard[2][2].count("; ") == 3  # every level tried is reported
    alone = _recompute(host_room=1 << 40, qkv=3072)  # Q, K and V without the projection's output
    alone.deferral.link.record(rows, rows * (2048 + 1040 + 3072 + 10) / 50e9)
    assert alone.attention_keeps_up(rows, hidden, GPU) and alone.kept[rows] == Keeping(True, False, True)


def test_a_layer_learns_the_extras_before_its_first_pass_where_the_link_is_timed() -> None:
    # Timed and asked, but not yet decided (the answer comes at a forward's first layer): the store a
    # layer's checkpoint makes gets the decided answer, as every later layer's will.
    rows, hidden = 8192, 1024
    run = _recompute(host_room=1 << 40, projection=2048, qkv=3072)
    assert run.attention_keeps_up(rows, hidden, GPU) is False  # untimed: asked
    run.deferral.link.record(rows, 1.0)
    assert rows not in run.kept
    assert run.extras_at(torch.empty(1, rows, hidden, device="meta")) == Keeping(True, True, True) == run.kept[rows]
    forced = _recompute(host_room=1 << 40, projection=2048)
    forced.keep_attention = "on"
    assert forced.extras_at(torch.empty(1, 8, hidden, device="meta")) == Keeping(True, True, False)
    assert forced.kept_bytes_at(8) == 1040 + 2048
