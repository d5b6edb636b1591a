"""The host link one run's offloaded checkpointing pages tensors over, and how long a layer gives it.

Offloading pages each layer's input out to pinned host memory during the layer's first pass, on one
copy stream, and optional tensors with it: the MLP's gate product E where a recomputed MLP keeps
whole rows (`kestrel.recompute.mlp_deferral`, `defer_mlp: fit`) and the attention output where
`keep_attention: auto` keeps it. A CUDA-graphed layer pages through two alternating static
buffers, so its copies must end before the layer two above reuses them: the forward runs a layer
per max(first pass, copies). A page that makes the copies outlast the first pass slows every layer.
`HostLink.keeps_up` asks that of a row count's bytes: the link's rate is measured once a device
(`measure_link_rate`), a layer's first pass once a row count (`Recompute` marks the forward's first
decoder layer and hands the time over between forwards, `record`).
"""

from __future__ import annotations

from typing import Callable

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
