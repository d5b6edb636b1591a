"""Page-locked host memory for offloaded checkpointing (`kestrel.recompute.checkpoint`), and the side
stream its copies run on.

The pinned buffers are exact-size and reused across steps (`_PinnedPool`): `pin_memory=True`
goes through torch's caching host allocator, which rounds every block up to a power of two, so a
400k-token Llama-8B layer input (3.3 GB) took 4.3 GB and 32 layers 137 GB instead of 105 GB, more
than the host had. `release_pinned_memory()` gives the free ones back when a run ends.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import torch

from kestrel.errors import KestrelError
from kestrel.recompute.graph_inputs import dense_view


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class HostMemoryError(KestrelError, RuntimeError):
    """Host memory could not be page-locked for offloaded layer inputs."""


def _register_host(ptr: int, nbytes: int) -> int:
    """Page-lock `nbytes` at `ptr` for the GPU's copy engines; the cudaError code (0: success)."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _unregister_host(ptr: int) -> int:
    """Undo `_register_host(ptr, ...)`; the cudaError code (0: success)."""
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


def _pinned_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory, as a uint8 tensor.

    Pages of its own (an anonymous mapping, `nbytes` rounded up to whole pages), registered with
    CUDA, rather than `pin_memory=True`, whose caching allocator rounds the block up to a power
    of two. Own pages: locking is per page, so no other memory shares a locked page, and the
    storage starts where the registration does (`is_pinned()` asks about the storage's start).
    The mapping is unmapped when the last view of it goes (after `drop_free` unregistered it).
    """
    span = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    error = _register_host(pages.data_ptr(), span)
    if error != 0:
        raise HostMemoryError(
            f"could not page-lock {nbytes / 2**30:.2f} GiB of host memory for an offloaded layer "
            f"input (cudaError {error}); the machine is probably out of RAM. Lower max_seq_length "
            "or batch_size, or set gradient_checkpointing: standard (layer inputs kept on the GPU)."
        )
    return pages[:nbytes]


class _PinnedPool:
    """Exact-size page-locked host buffers for one device's offloaded layer inputs, reused from
    step to step (registering gigabytes takes a while).

    Reuse needs no events: every copy into or out of these buffers is enqueued on the one side
    stream of this device (`side_stream`), so a reused buffer's next copy out runs after its
    last copy back (or copy out, for a graph dropped before its backward). That is why there is
    a pool per device. Only freeing a buffer waits, for that stream (`drop_free`).

    `acquire` runs in the forward, `release` in the backward or from a finalizer (autograd's
    thread, or the garbage collector inside this very pool's code): the lock is reentrant, and
    `release` only appends, which moves no index `acquire` holds.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.free: list[torch.Tensor] = []
        self.lock = threading.RLock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A free buffer of at least `nbytes` (the smallest such), else a new one of exactly
        `nbytes`. Before allocating, the free buffers (all smaller, then) are freed, so batches
        whose lengths vary do not pile up buffers: the pool tracks the largest recent size."""
        with self.lock:
            fits = [i for i, buf in enumerate(self.free) if buf.numel() >= nbytes]
            if fits:
                return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        self.drop_free()
        return _pinned_buffer(nbytes)

    def release(self, buf: torch.Tensor) -> None:
        """Put `buf` back on the free list; its copies already enqueued may still be running."""
        with self.lock:
            self.free.append(buf)

    def drop_free(self) -> int:
        """Unlock and free every free buffer, once the copies queued on them are done; returns the
        bytes given back. Buffers in use are left alone."""
        with self.lock:
            dropped, self.free = self.free, []
        if dropped and self.device.type == "cuda":
            side_stream(self.device).synchronize()
        errors = [e for e in (_unregister_host(buf.data_ptr()) for buf in dropped) if e != 0]
        if errors:
            raise RuntimeError(f"cudaHostUnregister failed on {len(errors)} buffers (cudaError {errors[0]})")
        return sum(buf.numel() for buf in dropped)


_POOLS: dict[torch.device, _PinnedPool] = {}


def _pool_for(device: torch.device) -> _PinnedPool | None:
    """The pinned-buffer pool for layer inputs from `device`; None off CUDA (plain host memory)."""
    if device.type != "cuda":
        return None
    if device not in _POOLS:
        _POOLS[device] = _PinnedPool(device)
    return _POOLS[device]


def host_buffer(owner: object, hidden: torch.Tensor) -> tuple[torch.Tensor, weakref.finalize | None]:
    """Host memory for `hidden`'s copy, laid out as `hidden` is where that is dense (`dense_view`: torch copies a
    tensor to or from host memory laid out otherwise through a contiguous copy on the device), and
    (when pooled) the call that gives it back: run by `owner.take()`, or by the collector when `owner` goes
    without a backward."""
    pool = _pool_for(hidden.device)
    if pool is None:
        flat = torch.empty(hidden.numel(), dtype=hidden.dtype, device="cpu")
        return dense_view(flat, tuple(hidden.shape), hidden.stride()), None
    nbytes = hidden.numel() * hidden.element_size()
    buf = pool.acquire(nbytes)
    give_back = weakref.finalize(owner, pool.release, buf)
    give_back.atexit = False
    return dense_view(buf[:nbytes].view(hidden.dtype), tuple(hidden.shape), hidden.stride()), give_back


def release_pinned_memory() -> int:
    """Unlock and free the offloaded layer inputs' pinned buffers not in use (call when a run
    ends: they hold up to a layer input per decoder layer of RAM); returns the bytes freed."""
    return sum(pool.drop_free() for pool in list(_POOLS.values()))
