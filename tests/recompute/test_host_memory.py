"""kestrel.recompute.host_memory's pinned buffers: exact-size, the smallest free one that fits reused,
smaller free ones dropped before a larger one is made, the free ones given back at the end of a
run, and a failed page-lock that says what to lower.

These run on the CPU: CUDA's page-locking is replaced by a fake that records what is registered
(`fake_pinning`, tests/conftest.py), and `_pool_for` hands out pools for CPU tensors too."""

from __future__ import annotations

import mmap

import pytest
import torch

from kestrel.recompute import host_memory
from kestrel.errors import KestrelError
from kestrel.recompute.host_memory import _PinnedPool, release_pinned_memory

PAGE = mmap.PAGESIZE


def _pool() -> _PinnedPool:
    return host_memory._pool_for(torch.device("cpu"))


def test_buffers_are_exact_size_not_a_power_of_two(fake_pinning: dict[int, int]) -> None:
    nbytes = 3 * (1 << 20) + 5  # a power-of-two allocator would take 4 MiB
    buf = _pool().acquire(nbytes)
    assert buf.numel() == nbytes and buf.dtype == torch.uint8 and buf.data_ptr() % PAGE == 0
    assert fake_pinning == {buf.data_ptr(): -(-nbytes // PAGE) * PAGE}
    assert buf.untyped_storage().nbytes() == -(-nbytes // PAGE) * PAGE


def test_the_smallest_free_buffer_that_fits_is_reused(fake_pinning: dict[int, int]) -> None:
    pool = _pool()
    bufs = {n: pool.acquire(n) for n in (100, 300, 200)}
    for buf in bufs.values():
        pool.release(buf)
    ptrs = {n: b.data_ptr() for n, b in bufs.items()}
    assert pool.acquire(150).data_ptr() == ptrs[200]
    assert pool.acquire(250).data_ptr() == ptrs[300]
    assert pool.acquire(100).data_ptr() == ptrs[100]
    assert len(fake_pinning) == 3 and pool.free == []  # nothing new registered


def test_smaller_free_buffers_are_dropped_before_a_larger_one_is_made(fake_pinning: dict[int, int]) -> None:
    pool = _pool()
    in_use = pool.acquire(50)
    small = [pool.acquire(n) for n in (100, 200)]
    for buf in small:
        pool.release(buf)
    big = pool.acquire(10_000)
    assert set(fake_pinning) == {in_use.data_ptr(), big.data_ptr()}  # the smaller free ones unregistered
    assert big.numel() == 10_000 and pool.free == []


def test_release_pinned_memory_frees_only_the_free_buffers(fake_pinning: dict[int, int]) -> None:
    pool = _pool()
    in_use, free = pool.acquire(1000), pool.acquire(3000)
    pool.release(free)
    assert release_pinned_memory() == 3000
    assert set(fake_pinning) == {in_use.data_ptr()} and pool.free == []
    pool.release(in_use)
    assert release_pinned_memory() == 1000 and fake_pinning == {}


def test_a_failed_registration_says_what_to_lower(
    fake_pinning: dict[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_memory, "_register_host", lambda ptr, nbytes: 2)  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match=r"3\.00 GiB.*max_seq_length.*gradient_checkpointing: standard"):
        _pool().acquire(3 << 30)
    assert isinstance(host_memory.HostMemoryError("x"), KestrelError)  # train.run reports it


@pytest.mark.parametrize("pooled", [True, False], ids=["pinned-pool", "plain"])
def test_a_host_copy_is_laid_out_as_the_tensor_it_copies_where_that_is_dense(
    pooled: bool, request: pytest.FixtureRequest
) -> None:
    """Attention's output O (B, H, S, D) is a transposed view of (B, S, H, D) memory: its host copy (and so the
    copy back, `_landing`, and a graphed layer's static buffer, from `like`) keeps that layout, so copying it out
    is one flat copy and the backward does not lay it out again. A slice, not dense, is copied contiguously."""
    if pooled:
        request.getfixturevalue("fake_pinning")
    owner = type("Owner", (), {})()
    for batch in (2, 1):  # a leading dimension of one: its stride says nothing about the layout
        o = torch.randn(batch, 5, 3, 4).transpose(1, 2)  # (B, H=3, S=5, D=4) over (B, S, H, D) memory
        buf, _ = host_memory.host_buffer(owner, o)
        assert buf.shape == o.shape and not buf.is_contiguous()
        assert all(buf.stride(d) == o.stride(d) for d in range(4) if o.shape[d] > 1), (buf.stride(), o.stride())
        buf.copy_(o)
        assert torch.equal(buf, o)
    for other in (torch.randn(6, 8)[:, :4], torch.randn(3, 1).expand(3, 4), torch.tensor(2.0)):  # slice, broadcast, 0-d
        buf, _ = host_memory.host_buffer(owner, other)
        assert buf.shape == other.shape and buf.is_contiguous()
        buf.copy_(other)
        assert torch.equal(buf, other)


def test_a_kept_attention_output_comes_back_in_its_own_layout() -> None:
    """What the recompute takes back is laid out as what the first pass kept (on the CPU the host copy itself)."""
    from kestrel.recompute.host_tensors import KeptAttentionOutput, OffloadState

    kept = KeptAttentionOutput(OffloadState())
    o, lse = torch.randn(2, 5, 3, 4).transpose(1, 2), torch.randn(2, 3, 5)
    kept.keep(o, lse)
    assert kept.out.like == (tuple(o.shape), o.stride(), o.dtype)
    back, back_lse = kept.take()
    assert back.stride() == o.stride() and torch.equal(back, o) and torch.equal(back_lse, lse)
