"""Tensors kept in pinned host memory from a checkpointed layer's first pass to its backward
(offloaded checkpointing, `kestrel.recompute.checkpoint`): the layer input (`_HostCopy`), its MLP's
gate product (`_KeptGate`) and, where the run keeps it, its attention output and logsumexp
(`KeptAttentionOutput`, `kestrel.model.kept_attention`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from typing import Any, Callable, Iterator

import torch

from kestrel.model.kept_attention import worth_keeping

from kestrel.recompute.host_memory import HostMemoryError, host_buffer, side_stream

log = logging.getLogger("kestrel")


@dataclasses.dataclass
class OffloadState:
    """One run's bookkeeping of offloaded tensors (`_HostTensor`)."""

    # Tensors whose copy out may still be running, each with the event that marks its end.
    reading: list[tuple[torch.Tensor, Any]] = dataclasses.field(default_factory=list)
    last: weakref.ref | None = None  # the layer-input copy made most recently (`_HostCopy`)
    side_use: dict[int, Any] = dataclasses.field(default_factory=dict)  # static buffer address -> its last copy's end
    warned: bool = False  # "not paging activations out" said once

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
        """Where the copy back lands: a new block of the compute stream's pool, laid out as the host copy."""
        return torch.empty_strided(self.host.shape, self.host.stride(), dtype=self.host.dtype, device=self.device)

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
        self.attention: KeptAttentionOutput | None = None  # its attention output, when the run keeps it
        self._keep(hidden)

    def prefetch(self) -> None:
        """Start the copy back to the device (CUDA), once; and the kept gate product's and attention output's."""
        if self.gate is not None:
            self.gate.prefetch()
        if self.attention is not None:
            self.attention.prefetch()
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

    In a CUDA-graphed layer (`layer_graphs.GraphedLayer`, the `graph_state.GateKeeper` it
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
    def like(self) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None:
        """E's shape, strides and dtype once a first pass has kept it (None before, or if it did not)."""
        return None if self.host is None else (tuple(self.host.shape), self.host.stride(), self.host.dtype)

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
            raise RuntimeError("a layer's kept tensor (gate product, attention output) was kept twice in one forward")
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

    @contextlib.contextmanager
    def as_held(self) -> Iterator[None]:
        """`graph_state.GateKeeper.as_held`: a bound buffer reads as holding E until the block ends."""
        holds = self.holds
        self.holds = holds or self.static is not None
        try:
            yield
        finally:
            self.holds = holds

    def _landing(self) -> torch.Tensor:
        return self.static if self.bound else super()._landing()

    def _guard(self, current: torch.cuda.Stream) -> None:
        if self.bound:  # a static buffer is never freed: its next first pass waits for the copy
            self.state.side_use[self.static.data_ptr()] = self.ready
        else:
            super()._guard(current)

    def _warn(self, err: HostMemoryError) -> None:
        if not self.state.warned:
            log.warning("not paging activations out (%s); recomputing them instead", err)
            self.state.warned = True


class KeptAttentionOutput:
    """A layer's causal attention output O (B, Hq, S, D) and logsumexp kept in pinned host memory from
    its first pass to its recompute, which then runs no attention forward (`kestrel.model.kept_attention`;
    the model's `AttentionStore`). Rides along with the layer input's `_HostCopy` (copied back with it).
    When host memory cannot be page-locked, nothing is kept (the recompute computes attention), with a warning.
    In a CUDA-graphed layer each lives in a static buffer between the passes, as the gate product does
    (`_KeptGate`; `slot`: which of two, alternating by layer)."""

    def __init__(self, state: OffloadState, slot: int = 0, only_long: bool = False,
                 link: Callable[[int, int, torch.device], bool] | None = None, projection: bool = False,
                 qkv: bool = False) -> None:
        self.out, self.lse = _KeptGate(state, slot), _KeptGate(state, slot)
        self.only_long = only_long  # keep only rows worth it (`kestrel.model.kept_attention.worth_keeping`)
        self.link = link  # (rows, hidden, device) -> whether the host link has room for them; None: always
        # `keep_projection`: the output projection's output too, kept with (and only with) O and lse
        self.proj = _KeptGate(state, slot) if projection else None
        # `keep_qkv`: the Q, K and V projections' outputs too, likewise
        self.qkv = tuple(_KeptGate(state, slot) for _ in range(3)) if qkv else ()

    @property
    def keeps_projection(self) -> bool:
        return self.proj is not None

    @property
    def keeps_qkv(self) -> bool:
        return bool(self.qkv)

    def admits(self, seq: int, rows: int, hidden: int, device: torch.device) -> bool:
        """`kestrel.model.kept_attention.AttentionStore.admits`: long enough rows where `only_long`, and room
        on the host link where `link` is given."""
        if self.only_long and not worth_keeping(seq, hidden):
            return False
        return self.link is None or self.link(rows, hidden, device)

    def keepers(self) -> tuple[_KeptGate, ...]:
        """The kept tensors (O, lse, the output projection's output and Q, K, V where kept), for a CUDA-graphed
        layer to bind to its static buffers (`GraphedLayer`)."""
        return (self.out, self.lse, *(() if self.proj is None else (self.proj,)), *self.qkv)

    def keep(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.out.keep(out)
        self.lse.keep(lse)

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(O, lse) back on the device for the recompute, or None when either was not kept."""
        out, lse = self.out.take(), self.lse.take()
        return None if out is None or lse is None else (out, lse)

    def keep_projection(self, y: torch.Tensor) -> None:
        """The first pass's output projection output y, after O was kept. The layer then adds its residual
        into y in place: an eager copy out runs on the side stream, so it copies a clone; a bound buffer
        takes its copy in stream order."""
        if self.proj is not None:
            self.proj.keep(y if self.proj.bound else y.clone())

    def take_projection(self) -> torch.Tensor | None:
        """The kept output projection output, back on the device for the recompute (None if not kept)."""
        return None if self.proj is None else self.proj.take()

    def keep_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The first pass's Q, K and V projection outputs, before the layer turns q and k in place (norms
        aside, RoPE): an eager copy out runs on the side stream, so it copies clones of those two; a bound
        buffer takes its copy in stream order."""
        for keeper, t, turned in zip(self.qkv, (q, k, v), (True, True, False)):
            keeper.keep(t if keeper.bound or not turned else t.clone())

    def take_qkv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The kept Q, K and V, back on the device for the recompute (None unless all three were kept)."""
        got = tuple(keeper.take() for keeper in self.qkv)
        return None if not got or any(t is None for t in got) else got  # type: ignore[return-value]

    def prefetch(self) -> None:
        for keeper in self.keepers():
            keeper.prefetch()
