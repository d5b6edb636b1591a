"""The stream CUDA graphs of decoder layers are captured on (`kestrel.recompute.layer_graphs`): the cuBLAS
workspaces it needs made before a capture, and the graph that keeps the graphs' shared pool in use.

`performance.capture_stream` says which stream. `side`: the run's steps run on the device's default stream, on
which nothing can be captured, so the graphs capture on a side stream of their own. cuBLAS then keeps a
workspace for each of its handles (this thread's, autograd's device thread's) on each stream (32 MiB each on
Hopper), and the caching allocator keeps each stream's freed blocks for that stream alone: the side stream's
cache and workspaces sit beside the default stream's. `steps`: the run's steps run on a stream of their own
(`steps_stream`, entered by `steps_on`) and the graphs capture on that same stream, so one set of workspaces
and one stream's cache serve the eager work and the captures. A replay runs on the stream current at the
replay either way, in the steps' order."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from kestrel import env
from kestrel.constants import CAPTURE_STREAMS


def capture_stream_mode(configured: str) -> str:
    """The run's `capture_stream`: KESTREL_CAPTURE_STREAM (side | steps, a debugging override) wins."""
    return env.override("KESTREL_CAPTURE_STREAM", configured, CAPTURE_STREAMS)


def steps_stream(device: torch.device, mode: str) -> torch.cuda.Stream | None:
    """A new stream for a run's steps where its (resolved) `capture_stream` is `steps` and `device` is a GPU; made
    once a run and entered around its steps (`steps_on`). None otherwise: the steps run on the current stream."""
    if mode != "steps" or device.type != "cuda":
        return None
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def steps_on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the block on `stream` (as it is for None). The stream first waits for the work queued on the current
    stream (the weights, a batch moved there), and the current stream waits for the block's work after it, so
    what runs after the block (a save, a metric read) sees the block's results."""
    if stream is None:
        yield
        return
    before = torch.cuda.current_stream(stream.device)
    stream.wait_stream(before)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        before.wait_stream(stream)


def capture_on(current: Any, default: Any, side: Callable[[], Any], on_steps: bool) -> Any:
    """The stream a registry's graphs capture on: under `capture_stream: steps` (`on_steps`) the current stream, the
    steps' own, unless it is the device's default stream (nothing can be captured on that: a run whose steps were
    not moved, a reference pass before its loop); else the registry's side stream (`side()`, made once)."""
    return current if on_steps and current != default else side()


def pool_keeper(pool: Any, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph | None:
    """A one-kernel graph captured into the graphs' shared `pool`, held as long as the device's entry, so
    the pool always has a user. The caching allocator counts a private pool's graphs; once the last is
    destroyed (static buffers outgrown: `drop_viewing`) a pool it has not yet freed, as under expandable
    segments, makes the next capture into it fail an internal assert (`use_count > 0`), and every layer
    would then run eagerly. None where it does not capture (that capture's own failure shows then)."""
    if torch.cuda.is_current_stream_capturing():  # not from inside another capture: keep without a keeper
        return None
    flag = torch.zeros(1, device=stream.device)  # outside the pool: the graph allocates nothing
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            flag.zero_()
    except RuntimeError:
        return None
    return graph


def warm_stream(stream: torch.cuda.Stream) -> None:
    """Give the cuBLAS handles of this thread and of autograd's device thread their workspaces on the capture
    stream before capturing: made during a capture, a workspace would come from, and stay in, the graphs'
    pool (which `release` could then never free). The device thread's: a backward captured from the main
    thread (`torch.autograd.grad` in a layer's first pass) runs its CUDA nodes there, on the stream their
    forward ran on."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        x = torch.ones(1, device=stream.device, requires_grad=True)
        with torch.enable_grad():
            y = _MatmulsBoth.apply(x)
        _matmuls(stream.device)
        torch.autograd.grad(y, x)
    current.wait_stream(stream)


def _matmuls(device: torch.device) -> None:
    """The products whose cuBLAS handles take a workspace: bf16 and bf16 -> fp32 (`lora_casts.mm_to`)."""
    a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
    torch.mm(a, a).addmm_(a, a)
    torch.mm(a, a, out_dtype=torch.float32)


class _MatmulsBoth(torch.autograd.Function):
    """Identity whose backward runs `_matmuls` (on autograd's device thread, on the forward's stream)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _matmuls(grad.device)
        return grad
