"""The stream CUDA graphs of decoder layers are captured on (`kestrel.recompute.layer_graphs`): the cuBLAS
workspaces it needs made before a capture, and the graph that keeps the graphs' shared pool in use."""

from __future__ import annotations

from typing import Any

import torch


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
