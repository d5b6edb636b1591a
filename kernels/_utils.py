"""Small host-side helpers shared by the Triton launchers: block sizes, warps, 2-D row views,
and the memory checks that make in-place writes safe. Nothing here launches a kernel or syncs."""

from __future__ import annotations

import functools

import torch
import triton

# A row wider than this would not fit one program's registers (Triton caps a block at 2^20
# elements; 64K columns is already far past any hidden size in use).
MAX_FUSED_SIZE = 65536


def block_and_warps(n_cols: int) -> tuple[int, int]:
    """Power-of-two block covering `n_cols` and a warp count that keeps about 8-16 elements per
    thread, the range where these memory-bound kernels reach copy bandwidth."""
    block = triton.next_power_of_2(n_cols)
    if block > MAX_FUSED_SIZE:
        raise ValueError(f"rows of {n_cols} columns exceed the fused limit of {MAX_FUSED_SIZE}")
    if block >= 32768:
        return block, 32
    if block >= 8192:
        return block, 16
    if block >= 2048:
        return block, 8
    return block, 4


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` (..., n) as a 2-D (rows, n) tensor whose last dimension has stride 1.

    A view whenever `reshape` can make one (any row stride is fine: the kernels take it as an
    argument); a contiguous copy otherwise, e.g. for an expanded gradient whose strides are 0.
    """
    rows = t.reshape(-1, t.shape[-1])
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]:
        # Rows overlap (stride 0 from `expand`): a kernel writing per row would race.
        rows = rows.contiguous()
    return rows


def non_overlapping(t: torch.Tensor) -> bool:
    """True when no two elements of `t` share a memory location, so a kernel may write `t` in
    place (holes are fine: a slice of a fused QKV projection qualifies, an `expand` does not).

    Sufficient test: sorted by stride, each dimension must step past the whole extent of the
    dimensions below it.
    """
    dims = sorted(
        ((stride, size) for stride, size in zip(t.stride(), t.shape) if size != 1),
        key=lambda sd: sd[0],
    )
    extent = 1
    for stride, size in dims:
        if stride < extent:
            return False
        extent = stride * size
    return True


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device; a small fixed number elsewhere (the
    interpreter runs programs one after another, so fewer programs is simply faster)."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
