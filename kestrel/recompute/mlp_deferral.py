"""Whether a checkpointed layer's recomputed MLP defers to its backward: one run's policy.

A deferred MLP (`kestrel.kernels.lora.mlp`) runs nothing in its recompute's forward and then the
forward and the backward together in chunks of `DEFERRED_ROWS` rows, so its (rows, I)
intermediates E, G and h no longer grow with the sequence. It does the same products as a
recompute that keeps them, but it gives up two things the whole-rows path has:

- offloaded checkpointing's paged gate product E (the recompute then skips its largest product);
- the merged weights and whole-row products of one pass (chunks of 2,048 rows, weights kept dense).

So deferring buys memory and nothing else. Its saving, for one layer at a time (the recompute of
one layer is alive at once), is 2 (3 M I - 3 min(M, C) I - W) bytes, W the dense
gate and up weights a deferred NF4 MLP keeps (`kestrel.kernels.lora.mlp.extra_bytes`). The modes
(`performance.defer_mlp`):

- `memory` (the default): defer wherever that saving is positive (`kestrel.kernels.lora.mlp.lowers_peak`).
- `fit`: defer where the whole-rows recompute would not fit, or where paging its E out would not hide
  under the layer's own work. Memory: its extra bytes are more than half
  of the device's headroom when a row count is first seen (memory the device has free plus what the
  caching allocator holds unused). Half, because that first sighting is a first pass, before the
  step's backward, its loss chunk and (on the first step) the optimizer's state have taken theirs:
  the other half is left to them. Where offloaded checkpointing pages E out (`paged_layers` of the
  layers), whole rows also need those pages, rows x I x 2 bytes a layer, to fit in half of the host
  memory available then (pinned pages cannot be swapped out). Off CUDA there is no device headroom
  to read, and `fit` keeps the memory rule. Where E is paged, its device need counts the two static
  (rows, I) buffers a CUDA-graphed layer pages E through. The host link: a paging layer sends E and
  its own input out, rows x (I + H) x 2 bytes (and its attention output where `keep_attention`
  keeps it, `kept_bytes`), on one copy stream while the layers above compute. A graphed layer
  pages E through two alternating static buffers, so its copy must end before the layer two above
  reuses the buffer: the forward then runs a layer per max(first pass, copy), and where the copy is
  the longer, whole rows lose more than the recompute's gate product saves them (a 1B model with a
  wide MLP: bench/RESULTS.md, session 37). So `fit` keeps whole rows only where those bytes, at the
  link's rate, take no longer than a layer's first pass at that row count
  (`kestrel.recompute.host_link`: the rate measured once a device; `Recompute` times the forward's
  first decoder layer's first pass the second time a row count is seen (the first compiles and tunes
  kernels), as the GPU runs it with no wait on the host (`host_link.FirstPassTimes`): what a graphed
  layer takes, and an eager pass's launch gaps made a small model's link look free (session 38); a
  cheap sliding-window first layer is timed short, which errs toward deferring). Until a row count's time is in, it defers;
  the answer is decided again at the next forward with that row count and reported again, unless a
  forward of it already ran as CUDA graphs (auto graphs try a new layout eagerly for four forwards
  first; forced on, or inferred graphed, a layout can capture before its time is in), whose
  captures may hold the untimed answer: then that answer stays. Faster where that holds
  (bench/RESULTS.md, sessions 36-37: 5-7% on long rows of 3B-7B models), at that memory.
- `off`: never defer.

Each row count's answer is decided once and kept (`fit`'s untimed answer until its timing is in,
which happens between forwards), so a layer's first pass (which pages E out or not) and its
recompute (which takes E back or defers) always agree, and CUDA graphs captured for a layout stay
valid. Each MLP's first answer, and each change of answer between row counts, is reported
(`on_decision`: the run's log and `performance.json`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

import torch

from kestrel import env
from kestrel.constants import DEFER_MODES
from kestrel.kernels.lora import mlp
from kestrel.kernels.lora.mlp import dense_elements, extra_bytes
from kestrel.recompute.host_link import HostLink, measure_link_rate

DeferMode = Literal["memory", "fit", "off"]


def cuda_headroom(device: torch.device) -> int | None:
    """Bytes the device could still give this process: free on the device plus what the caching
    allocator reserved and does not use; None off CUDA."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def available_host_bytes(path: str = "/proc/meminfo") -> int | None:
    """The host memory available to new allocations without swapping (MemAvailable), or None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclasses.dataclass(frozen=True)
class DeferDecision:
    """One row count's answer, as the run's log and metrics show it."""

    rows: int
    inter: int
    deferred: bool
    reason: str
    untimed: bool = False  # `fit` before this row count's first pass was timed: decided again once it is

    def as_metrics(self) -> dict[str, Any]:
        return {"rows": self.rows, "intermediate": self.inter, "deferred": self.deferred, "reason": self.reason}


class MLPDeferral:
    """One run's deferral policy (module docstring); `kestrel.kernels.lora.mlp.DeferPolicy`.
    `headroom(device)` reads the device's spare bytes, `host_room()` the host's and `link_rate(device)`
    the host link's bytes a second (tests hand in their own); `paged_layers`: how many layers page E
    out to the host (set by the run's `kestrel.recompute.checkpoint.Recompute`; 0 without offloading);
    `link`: the run's `HostLink`, whose layer times `Recompute` fills through `record_layer_time`
    where `wants_layer_time`."""

    def __init__(
        self, mode: DeferMode = "memory", headroom: Callable[[torch.device], int | None] = cuda_headroom,
        on_decision: Callable[[DeferDecision], None] | None = None,
        host_room: Callable[[], int | None] = available_host_bytes,
        link_rate: Callable[[torch.device], float | None] = measure_link_rate,
    ) -> None:
        if mode not in DEFER_MODES:
            raise ValueError(f"defer_mlp must be one of {', '.join(DEFER_MODES)}, got {mode!r}")
        self.mode, self.headroom, self.on_decision, self.host_room = mode, headroom, on_decision, host_room
        self.link = HostLink(link_rate)  # the run's host link (`Recompute` times its layers through it)
        self.paged_layers = 0
        # rows -> bytes a row that a paging layer sends beside E and its input at that row count (kept
        # attention: `Recompute.kept_bytes_at`)
        self.kept_bytes: Callable[[int], int] = lambda rows: 0
        self.reported: dict[tuple, DeferDecision] = {}  # each MLP width's last reported answer
        self.decided: dict[tuple[int, int, int, int, torch.device], DeferDecision] = {}

    def wants_layer_time(self, rows: int, device: torch.device) -> bool:
        """Whether `Recompute` should time a layer's first pass at `rows` rows before the layer runs:
        `fit` on a CUDA run that pages E, at a row count not yet timed that deferring could concern."""
        return (self.mode == "fit" and self.paged_layers > 0 and device.type == "cuda"
                and rows > mlp.DEFERRED_ROWS and not self.link.timed(rows))

    def host_short(self, pages: int) -> str | None:
        """Why pinning `pages` more bytes of host memory is refused (more than half the host memory
        available now, or that is unknown: pinned pages cannot be swapped out, and the rest of the step
        and the machine need room), or None where they fit. For paged gate products here and kept
        attention outputs (`Recompute.attention_keeps_up`)."""
        host = self.host_room()
        if host is not None and 2 * pages <= host:
            return None
        spare = "unknown" if host is None else f"{host / 2**30:.1f} GiB"
        return f"would pin {pages / 2**30:.1f} GiB of host memory ({spare} available)"

    def paged_bytes_per_row(self, rows: int) -> int:
        """Bytes a row that a paging layer's MLP sends over the host link at `rows` rows: its gate
        product E (I x 2, the widest MLP's) where an MLP decided at that row count keeps whole rows;
        0 where every one defers, none is decided yet, or no layer pages E."""
        if not self.paged_layers:
            return 0
        return max((d.inter * 2 for d in self.decided.values() if d.rows == rows and not d.deferred), default=0)

    def record_layer_time(self, rows: int, seconds: float, decide_again: bool = True) -> None:
        """A decoder layer's first pass took `seconds` at `rows` rows: the answers given for that row
        count before it was timed are decided again at their next call, where `decide_again`
        (`Recompute` calls this between forwards only, and keeps them where graphs may hold them)."""
        self.link.record(rows, seconds)
        for key in [k for k, d in self.decided.items() if d.rows == rows and d.untimed and decide_again]:
            del self.decided[key]

    def defers(self, rows: int, gate: Any, up: Any, device: torch.device) -> bool:
        """Whether an MLP of `rows` rows over `gate`, `up` defers its recompute to its backward."""
        dense = dense_elements(gate, up)
        key = (rows, gate.out_features, gate.in_features, dense, device)
        decision = self.decided.get(key)
        if decision is None:
            decision = self.decided[key] = self._decide(rows, gate.out_features, gate.in_features, dense, device)
            self._report(decision, key[1:])
        return decision.deferred

    def _report(self, decision: DeferDecision, mlp: tuple) -> None:
        """Tell `on_decision` of an MLP's first answer and of each change of answer as its row counts
        vary (batch layouts of many sizes would otherwise log a line each)."""
        last = self.reported.get(mlp)
        if self.on_decision is not None and (last is None or last.deferred is not decision.deferred or last.untimed):
            self.reported[mlp] = decision
            self.on_decision(decision)

    def _decide(self, rows: int, inter: int, hidden: int, dense: int, device: torch.device) -> DeferDecision:
        extra = extra_bytes(rows, inter, dense)
        gib = f"{extra / 2**30:.2f} GiB"
        if extra <= 0:
            return DeferDecision(rows, inter, False, "deferring would not lower the peak")
        if self.mode != "fit":
            way = "deferred" if self.mode == "memory" else "not deferred"
            return DeferDecision(rows, inter, self.mode == "memory", f"{way} (defer_mlp: {self.mode}); saves {gib}")
        room = self.headroom(device)
        if room is None:
            return DeferDecision(rows, inter, True, f"saves {gib}; no device headroom to read off CUDA")
        if self.paged_layers:  # a graphed layer pages E through two static (rows, I) buffers
            extra += 2 * rows * inter * 2
        need = f"whole rows need {extra / 2**30:.2f} GiB more, {room / 2**30:.2f} GiB spare"
        if 2 * extra > room:
            return DeferDecision(rows, inter, True, f"{need}: would not fit, deferred")
        pages = self.paged_layers * rows * inter * 2  # E of each paging layer, 16-bit
        short = self.host_short(pages) if pages else None
        if short is not None:
            return DeferDecision(rows, inter, True, f"{need}, but paging their gate products {short}: deferred")
        if not pages:
            return DeferDecision(rows, inter, False, f"{need}: fits, whole rows (faster)")
        keeps_up, link = self.link.keeps_up(rows, (inter + hidden) * 2 + self.kept_bytes(rows), device)
        if keeps_up is None:
            return DeferDecision(rows, inter, True, f"{need}: deferred until a layer's first pass at "
                                 "this row count is timed", untimed=True)
        if not keeps_up:
            return DeferDecision(rows, inter, True, f"{need}: fits, but {link}: deferred")
        return DeferDecision(rows, inter, False, f"{need}: fits, and {link}: whole rows (faster)")


def defer_mode(configured: str) -> DeferMode:
    """The run's deferral mode: KESTREL_DEFER_MLP (memory | fit | off, a debugging override) wins over the configured one."""
    return env.override("KESTREL_DEFER_MLP", configured, DEFER_MODES)  # type: ignore[return-value]
