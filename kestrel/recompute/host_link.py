"""The host link one run's offloaded checkpointing pages tensors over, and how long a layer gives it.

Offloading pages each layer's input out to pinned host memory during the layer's first pass, on one
copy stream, and optional tensors with it: the MLP's gate product E where a recomputed MLP keeps
whole rows (`kestrel.recompute.mlp_deferral`, `defer_mlp: fit`) and the attention output where
`keep_attention: auto` keeps it. A CUDA-graphed layer pages through two alternating static
buffers, so its copies must end before the layer two above reuses them: the forward runs a layer
per max(first pass, copies). A page that makes the copies outlast the first pass slows every layer.
`HostLink.keeps_up` asks that of a row count's bytes: the link's rate is measured once a device
(`measure_link_rate`), a layer's first pass once a row count (`Recompute` marks the forward's first
decoder layer and hands the time over between forwards, `record`; `FirstPassTimes` times it as a
CUDA-graphed layer runs, with no wait on the host).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterator

import torch


def measure_link_rate(device: torch.device, nbytes: int = 64 << 20) -> float | None:
    """Bytes a second the device copies to pinned host memory (the way offloading pages tensors
    out): the fastest of three copies of `nbytes`; None off CUDA or inside a graph capture."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    seconds = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return nbytes / min(seconds)


class HostLink:
    """One run's host link: its rate per device (`rate(device)`, measured on first use; tests hand in
    their own) and a decoder layer's first pass by row count (`layer_seconds`, filled by `record`)."""

    def __init__(self, rate: Callable[[torch.device], float | None] = measure_link_rate) -> None:
        self.measure = rate
        self.rates: dict[torch.device, float | None] = {}
        self.layer_seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        self.layer_seconds[rows] = seconds

    def timed(self, rows: int) -> bool:
        return rows in self.layer_seconds

    def keeps_up(self, rows: int, bytes_per_row: int, device: torch.device) -> tuple[bool | None, str]:
        """(whether a layer paging `bytes_per_row` a row at `rows` rows ends its copies within its first
        pass, the figures); None while this row count is untimed, or the rate unmeasured inside a graph
        capture (the caller asks again later)."""
        seconds = self.layer_seconds.get(rows)
        if seconds is None:
            return None, "a layer's first pass at this row count is not yet timed"
        if device not in self.rates:
            capturing = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if capturing:  # no timing inside a capture: the caller asks again later
                return None, "the host link's rate is not measured inside a CUDA graph capture"
            self.rates[device] = self.measure(device)
        rate = self.rates[device]
        if rate is None:
            return False, "the host link's rate could not be measured"
        paged = rows * bytes_per_row
        copy = paged / rate
        verdict = "longer than" if copy > seconds else "within"
        return copy <= seconds, (f"paging {paged / 2**20:.0f} MiB a layer takes {copy * 1e3:.2f} ms at "
                                 f"{rate / 1e9:.1f} GB/s, {verdict} its first pass ({seconds * 1e3:.2f} ms)")


@dataclasses.dataclass
class _PassTiming:
    """One first pass being timed: GPU marks before the lead, at the pass's start and end; the host's
    seconds from enqueueing the start mark to enqueueing the end mark."""

    lead: Any
    start: Any
    end: Any = None
    host_s: float = 0.0
    host_at: float = 0.0


class FirstPassTimes:
    """Times the forward's first decoder layer's first pass, one row count at a time, as the GPU runs it
    when nothing waits on the host: what a CUDA-graphed layer takes, the time the host link's copies
    must fit in (`HostLink.keeps_up`).

    An eager pass times the host's launch gaps too: a small layer's eager first pass took 3.5-5 ms on
    an H200 where its graphed pass is near 1 ms (bench/RESULTS.md, session 38), so the link looked
    free where it was not. So on CUDA the stream first idles for a lead (a spin kernel) while the host
    enqueues the whole pass behind it; the GPU then runs the pass back to back. The time counts only
    if the host's enqueueing did end within the lead (the marks say so once passed); otherwise the
    row count is timed again at a later forward with a lead twice the host's time, up to `tries`
    times, and the last time counts as it is (a pass that waits on the host, a sync inside it, can
    never be timed without its gaps). The first lead is a guess of `lead_cycles` GPU clock cycles;
    later ones are sized from the measured cycles a second. Off CUDA there is no lead and the
    clock's time counts."""

    def __init__(
        self, clock: Any, tries: int = 3, lead_cycles: int = 1 << 25,
        spin: Callable[[int], None] | None = None, host_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock, self.tries, self.cycles = clock, tries, lead_cycles
        # Holds the current stream for n clock cycles (torch's private `_sleep`; where a torch lacks it, passes
        # are timed without a lead, their launch gaps included).
        self.spin = spin if spin is not None else getattr(torch.cuda, "_sleep", None)
        self.host_clock = host_clock
        self.cycles_per_s: float | None = None
        self.running: dict[int, _PassTiming] = {}
        self.attempts: dict[int, int] = {}
        self.leads: dict[int, int] = {}  # rows -> the lead (cycles) its next try spins

    def start(self, rows: int, cuda: bool) -> None:
        """Before the pass: idle the stream for a lead (CUDA), then mark the pass's start."""
        led = cuda and self.spin is not None
        lead = self.clock.mark() if led else None
        if led:
            self.spin(self.leads.get(rows, self.cycles))
        self.running[rows] = _PassTiming(lead, self.clock.mark(), host_at=self.host_clock())
        self.attempts[rows] = self.attempts.get(rows, 0) + 1

    def stop(self, rows: int) -> None:
        """After the pass: mark its end."""
        timing = self.running[rows]
        timing.end = self.clock.mark()
        timing.host_s = self.host_clock() - timing.host_at

    def finished(self) -> Iterator[tuple[int, float]]:
        """(rows, seconds) of each timed pass the device has finished whose time counts; a pass the
        host held up is dropped, its row count to be timed again at a later forward."""
        for rows, timing in list(self.running.items()):
            if timing.end is None:
                continue
            seconds = self.clock.seconds(timing.start, timing.end)
            if seconds is None:
                continue
            del self.running[rows]
            lead_s = self.clock.seconds(timing.lead, timing.start) if timing.lead is not None else None
            if lead_s is not None and lead_s > 0:
                cycles = self.leads.get(rows, self.cycles)
                self.cycles_per_s = cycles / lead_s
                if timing.host_s > lead_s and self.attempts[rows] < self.tries:
                    self.leads[rows] = math.ceil(2 * timing.host_s * self.cycles_per_s)
                    continue
            yield rows, seconds

    def timing(self, rows: int) -> bool:
        """Whether a pass of `rows` rows is being timed now (not yet read)."""
        return rows in self.running
