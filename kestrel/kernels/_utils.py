"""Small host-side helpers shared by the Triton launchers: block sizes, warps, 2-D row views,
and the memory checks that make in-place writes safe. Nothing here launches a kernel or syncs.

Host cost matters at small shapes, where a launch is bound by Python rather than by the GPU:
whatever depends only on shapes, strides and dtypes is a pure function cached with
`functools.lru_cache` (keys are `torch.Size` / stride tuples, hashed in C), and `cdiv` /
`next_pow2` are plain integer arithmetic (Triton 3.6's `triton.cdiv` and
`triton.next_power_of_2` are constexpr functions, slow to call from the host)."""

from __future__ import annotations

import functools
import os

from kestrel import env
import torch

# A row wider than this would not fit one program's registers (Triton caps a block at 2^20
# elements; 64K columns is already far past any hidden size in use).
MAX_FUSED_SIZE = 65536


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0 (as `triton.cdiv`)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n for n >= 1, and 0 for n = 0 (as `triton.next_power_of_2`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def round_up_coarse(n: int) -> int:
    """`n` rounded up to three significant bits (4, 5, 6, 7 times a power of two): a trip count
    that is a compile-time constant takes few distinct values (a handful per octave of n_rows),
    while the programs it leads to stay within 80% of the target."""
    step = 1 << max(0, n.bit_length() - 3)
    return cdiv(n, step) * step


@functools.lru_cache(maxsize=None)
def block_and_warps(n_cols: int) -> tuple[int, int]:
    """Power-of-two block covering `n_cols` and a warp count that keeps about 8-16 elements per
    thread, the range where these memory-bound kernels reach copy bandwidth."""
    block = next_pow2(n_cols)
    if block > MAX_FUSED_SIZE:
        raise ValueError(f"rows of {n_cols} columns exceed the fused limit of {MAX_FUSED_SIZE}")
    if block >= 32768:
        return block, 32
    if block >= 8192:
        return block, 16
    if block >= 2048:
        return block, 8
    return block, 4


@functools.lru_cache(maxsize=1024)
def row_stride(shape: tuple[int, ...], stride: tuple[int, ...]) -> int | None:
    """The row stride `as_rows` gives a tensor of this `shape` and `stride` when it is a view,
    i.e. when its elements can be read in place as rows (prod(shape[:-1]), shape[-1]); None when
    `as_rows` would copy (leading dimensions that do not merge into one stride, a last stride
    other than 1, rows that overlap) or there are no elements. A single row reports shape[-1]."""
    if len(shape) == 0 or 0 in shape:
        return None
    n = shape[-1]
    if n > 1 and stride[-1] != 1:
        return None
    rows = None  # stride of the innermost leading dimension of size > 1; the others must chain
    expected = 0
    for size, st in zip(reversed(shape[:-1]), reversed(stride[:-1])):
        if size == 1:
            continue
        if rows is None:
            rows = st
        elif st != expected:
            return None
        expected = st * size
    if rows is None:
        return n
    return rows if rows >= n else None


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
    place (holes are fine: a slice of a fused QKV projection qualifies, an `expand` does not)."""
    return layout_non_overlapping(t.shape, t.stride())


@functools.lru_cache(maxsize=1024)
def layout_non_overlapping(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """`non_overlapping` on a shape and its strides. Sufficient test: sorted by stride, each
    dimension must step past the whole extent of the dimensions below it."""
    dims = sorted((st, size) for st, size in zip(stride, shape) if size != 1)
    extent = 1
    for st, size in dims:
        if st < extent:
            return False
        extent = st * size
    return True


@functools.lru_cache(maxsize=1024)
def layout_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Non-overlapping with no holes, in any dimension order, for a shape and its strides."""
    extent = 1
    for st, size in sorted((st, size) for st, size in zip(stride, shape) if size != 1):
        if st != extent:
            return False
        extent *= size
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


def interpreted() -> bool:
    """True under Triton's CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pdl(device: torch.device) -> bool:
    """True when launches on `device` use Programmatic Dependent Launch (Hopper and later, not
    interpreted, `KESTREL_PDL` not "0"): a kernel launched with it may start while the previous
    one drains, loads what cannot depend on it (weights), then waits (`griddepcontrol.wait`)
    for that launch's writes before reading its outputs. Read on each call, like `dispatch`.
    Off inside torch.compile: the compiler launches traced user kernels its own way."""
    if torch.compiler.is_compiling():
        return False
    if device.type != "cuda" or interpreted() or env.raw("KESTREL_PDL") == "0":
        return False
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_launch(use: bool) -> dict:
    """Launch keywords for a kernel with a `PDL` constexpr: Triton's `launch_pdl` only when on
    (the keyword is left out otherwise, for launchers that do not know it)."""
    return {"PDL": True, "launch_pdl": True} if use else {"PDL": False}
