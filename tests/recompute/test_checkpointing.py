"""kestrel.recompute.checkpoint's offloaded layer inputs and MLP gate products: copied out and back
exactly, the layer below's copy back started when a layer's backward begins, and a finished
step's copies let go; their pinned host buffers exact-size, reused, and given back.

The buffer tests run on the CPU: CUDA's page-locking is replaced by a fake that records what is
registered (`fake_pinning`, tests/conftest.py); the pool's own tests are in
test_host_memory.py."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from kestrel.recompute import checkpoint as checkpointing
from kestrel.recompute import host_memory
from kestrel.recompute.checkpoint import LayerCheckpoint, OffloadState, Recompute, _HostCopy, _KeptGate
from kestrel.recompute.graph_choice import GraphChooser, WallClock
from kestrel.recompute.host_memory import release_pinned_memory

PAGE = mmap.PAGESIZE
# (device, elements a tensor): on CUDA large enough (64 MB) that copies are still running when asked for
_SIZES = [("cpu", 1000), pytest.param(("cuda", 16 << 20), marks=pytest.mark.gpu)]


@pytest.fixture(params=_SIZES)
def sized(request: pytest.FixtureRequest) -> tuple[str, int]:
    """(device, elements a tensor); on CUDA the compute stream is kept busy first, so side-stream
    copies are still running when their results are asked for."""
    device, numel = request.param
    if device == "cuda":
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            a = a @ a / 64
    return device, numel


class _Current:
    now = OffloadState()


STATE = _Current()  # each test's offload bookkeeping, as one run's `Recompute` holds it


@pytest.fixture(autouse=True)
def _fresh_offload_state() -> None:
    STATE.now = OffloadState()


def _chain(device: str, n: int = 3, numel: int = 1000) -> tuple[list[torch.Tensor], list[_HostCopy]]:
    inputs = [torch.randn(numel, device=device) for _ in range(n)]
    return inputs, [_HostCopy(STATE.now, x) for x in inputs]


def test_copies_come_back_exactly_in_backward_order(sized: tuple[str, int]) -> None:
    device, numel = sized
    inputs, copies = _chain(device, numel=numel)
    assert copies[2].below() is copies[1] and copies[1].below() is copies[0]
    originals = [x.clone() for x in inputs]
    del inputs  # their memory may be reused now: the copies must not depend on it
    got = copies[2].take()
    assert torch.equal(got, originals[2]) and copies[2].host is None
    if device == "cuda":
        assert copies[1].fetched is not None  # started when the layer above began its backward
    assert torch.equal(copies[1].take(), originals[1])
    assert torch.equal(copies[0].take(), originals[0])


def test_gate_products_come_back_exactly(sized: tuple[str, int]) -> None:
    """Layer copies with their gate products: both come back exactly, the layer below's gate
    copy started with its input's."""
    device, numel = sized
    inputs, copies = _chain(device, numel=numel)
    gates = [torch.randn(2 * numel, device=device) for _ in copies]
    for copy, gate in zip(copies, gates):
        copy.gate = _KeptGate(STATE.now)
        copy.gate.keep(gate)
    originals = [g.clone() for g in gates]
    del gates, inputs
    copies[2].take()
    if device == "cuda":
        assert copies[1].gate.fetched is not None and copies[0].gate.fetched is None
    for i in (2, 1, 0):
        copy, original = copies[i], originals[i]
        if i < 2:
            copy.take()
        got = copy.gate.take()
        assert torch.equal(got, original) and copy.gate.host is None
        assert copy.gate.take() is None  # taken once


def test_bound_gates_come_back_into_their_buffers(sized: tuple[str, int]) -> None:
    """Gates bound to static buffers, as graphed layers use them: two buffers, layers
    alternating; each layer's E written there, copied out, and overwritten two layers up before
    its backward; each comes back into its buffer exactly (on CUDA: the write two layers up waits
    for the copy out, and the backward's read for the copy back)."""
    device, numel = sized
    statics = [torch.empty(numel, device=device) for _ in range(2)]
    gates = [torch.randn(numel, device=device) for _ in range(4)]
    copies = []
    for i, e in enumerate(gates):
        copy = _HostCopy(STATE.now, torch.randn(8, device=device))
        copy.gate = gate = _KeptGate(STATE.now, slot=i % 2)
        gate.bind(statics[gate.slot])  # the compute stream waits for the copy out two layers down
        if i % 2:  # the MLP writes E where the gate says: its buffer, then keeps it (no copy)
            into = gate.target(tuple(e.shape), e.dtype)
            assert into is statics[gate.slot] and gate.target((1, numel), e.dtype) is None
            gate.keep(into.copy_(e))
        else:
            gate.keep(e)  # or keeps a new E: copied into the buffer
        gate.copy_out()
        copies.append(copy)
    originals = [e.clone() for e in gates]
    del gates
    for i in (3, 2, 1, 0):
        copies[i].take()
        got = copies[i].gate.take()
        assert got is statics[i % 2] and torch.equal(got, originals[i])
        assert copies[i].gate.take() is got  # the backward graph's own take: the same buffer
        got.fill_(float("nan"))  # the backward overwrites E in place


def test_a_gate_bound_to_nothing_or_not_copied_out_gives_nothing(
    fake_pinning: dict[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    unbound = _KeptGate(STATE.now)
    assert unbound.target((10,), torch.float32) is None  # eager: E goes to a new tensor
    unbound.bind(None)  # its first sighting kept no E (a deferred MLP): the graph computes E
    unbound.keep(torch.randn(10))
    unbound.copy_out()
    assert unbound.take() is None and unbound.host is None
    monkeypatch.setattr(host_memory, "_register_host", lambda ptr, nbytes: 2)
    STATE.now.warned = False
    failed = _KeptGate(STATE.now)
    failed.bind(torch.zeros(1000))
    failed.keep(torch.randn(1000))
    failed.copy_out()  # host memory cannot be locked: E is not kept
    assert failed.take() is None


def test_a_gate_kept_where_host_memory_cannot_be_locked_is_recomputed(
    fake_pinning: dict[int, int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(host_memory, "_register_host", lambda ptr, nbytes: 2)
    STATE.now.warned = False
    gate = _KeptGate(STATE.now)
    gate.keep(torch.randn(1000))
    assert gate.take() is None  # nothing kept: the MLP computes E
    assert "recomputing them instead" in caplog.text


def test_a_kept_gate_gives_its_buffer_back(fake_pinning: dict[int, int]) -> None:
    e = torch.randn(30, 70)
    gate = _KeptGate(STATE.now)
    gate.keep(e)
    pool = host_memory._pool_for(torch.device("cpu"))
    ptr = gate.host.data_ptr()
    assert pool.free == [] and torch.equal(gate.take(), e)
    assert [b.data_ptr() for b in pool.free] == [ptr]
    dropped = _KeptGate(STATE.now)
    dropped.keep(e)  # reuses the buffer; never taken (a step abandoned before its backward)
    assert dropped.host.data_ptr() == ptr and pool.free == []
    del dropped
    gc.collect()
    assert [b.data_ptr() for b in pool.free] == [ptr]


def test_finished_copies_are_released() -> None:
    _, copies = _chain("cpu")
    below = copies[0]
    del copies, below
    gc.collect()
    fresh = _HostCopy(STATE.now, torch.zeros(3))
    assert fresh.below is not None and fresh.below() is None  # no stale prefetch target


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_offloaded_layer_gives_the_same_gradients(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64).to(device) for _ in range(4)]
    x = torch.randn(8, 64, device=device, requires_grad=True)
    grads = {}
    for offload in (False, True):
        h, owner = x, Recompute(offload, None, GraphChooser("off"))
        for layer in layers:
            h = LayerCheckpoint.apply(lambda t, layer=layer: torch.tanh(layer(t)), owner, h)
        x.grad = None
        for layer in layers:
            layer.zero_grad()
        h.square().sum().backward()
        grads[offload] = [x.grad.clone(), *(p.grad.clone() for l in layers for p in l.parameters())]
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("offload", [False, True], ids=["standard", "offload"])
def test_a_no_grad_call_runs_the_layer_as_it_is(offload: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward in training mode under no_grad (a reference or KL pass) keeps nothing, copies
    nothing to the host and asks the graph chooser nothing: it is no training forward."""
    owner = Recompute(offload, None, GraphChooser("auto"))
    layer = torch.nn.Linear(16, 16)
    monkeypatch.setattr(LayerCheckpoint, "apply", lambda *a: pytest.fail("checkpointed under no_grad"))
    monkeypatch.setattr(owner.chooser, "begin", lambda *a: pytest.fail("a no-grad forward was timed"))
    x = torch.randn(4, 16)
    with torch.no_grad():
        y = owner(lambda t, scale: layer(t) * scale, x, 2.0)
    torch.testing.assert_close(y, layer(x).detach() * 2.0, rtol=0, atol=0)
    assert owner.offloaded.last is None and not owner.offloaded.reading


def test_a_copy_gives_its_buffer_back_when_taken(fake_pinning: dict[int, int]) -> None:
    x = torch.randn(4, 250)
    copy = _HostCopy(STATE.now, x)
    pool = host_memory._pool_for(torch.device("cpu"))
    assert pool.free == [] and len(fake_pinning) == 1
    ptr = copy.host.data_ptr()
    got = copy.take()
    assert torch.equal(got, x) and copy.host is None
    assert [b.data_ptr() for b in pool.free] == [ptr]
    again = _HostCopy(STATE.now, torch.zeros(4, 250))  # same size: the same buffer, and `got` is its own copy
    assert again.host.data_ptr() == ptr and torch.equal(got, x)
    del again
    gc.collect()
    assert len(pool.free) == 1  # the finalizer did not release twice (take() ran it already)


def test_a_copy_dropped_without_backward_gives_its_buffer_back(fake_pinning: dict[int, int]) -> None:
    copies = [_HostCopy(STATE.now, torch.randn(1000)) for _ in range(3)]
    pool = host_memory._pool_for(torch.device("cpu"))
    assert pool.free == []
    del copies
    gc.collect()
    assert len(pool.free) == 3 and len(fake_pinning) == 3


@pytest.mark.gpu
def test_offloaded_layers_on_cuda_use_exact_pinned_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    registrations: list[int] = []
    real = host_memory._register_host
    monkeypatch.setattr(host_memory, "_register_host", lambda p, n: registrations.append(n) or real(p, n))
    gc.collect()  # earlier tests' copies give their buffers back, then go
    release_pinned_memory()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(96, 96).cuda() for _ in range(3)]
    x = torch.randn(5, 7, 96, device="cuda", requires_grad=True)  # 13,440 bytes a layer input
    grads = {}
    for offload in (False, True, True):  # the second offloaded step reuses the first one's buffers
        h, x.grad, owner = x, None, Recompute(offload, None, GraphChooser("off"))
        for layer in layers:
            layer.zero_grad()
            h = LayerCheckpoint.apply(lambda t, layer=layer: torch.tanh(layer(t)), owner, h)
        if offload:
            host = h.grad_fn.saved_input.host
            assert host.is_pinned() and host.untyped_storage().nbytes() == -(-x.nbytes // PAGE) * PAGE
        h.square().sum().backward()
        grads[offload] = [x.grad.clone(), *(p.grad.clone() for l in layers for p in l.parameters())]
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(registrations) == 3
    assert release_pinned_memory() == 3 * x.nbytes


@pytest.mark.parametrize(("share", "chosen"), [("1", [1, 1, 1, 1]), ("0", [0, 0, 0, 0]), ("0.5", [0, 1, 0, 1]),
                                               ("0.25", [0, 0, 0, 1])])
def test_the_offload_gate_share_spreads_over_the_layers(
    share: str, chosen: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KESTREL_OFFLOAD_GATE", share)
    owner = Recompute(True, None, GraphChooser("off"), checkpointing.gate_share())
    assert [int(owner.pages_gate_out(depth)) for depth in range(4)] == chosen


@pytest.mark.parametrize("bad", ["yes", "1.5", "-0.1"])
def test_a_bad_offload_gate_share_says_what_is_valid(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_OFFLOAD_GATE", bad)
    with pytest.raises(ValueError, match="a share of the layers, 0 to 1"):
        checkpointing.gate_share()


def test_a_forward_that_captured_graphs_is_left_out_of_the_choice_times() -> None:
    """`spoil_after_capture`: at a training forward's start, the forward ending then is dropped from the graph
    choice's times where layer graphs were captured since the last start (after a drop of the graphs, or a
    static buffer outgrown), and only then."""
    now = [0.0]
    owner = Recompute(False, None, GraphChooser("auto", WallClock(lambda: now[0])))
    for captured in (False, False, True, False):
        owner.spoil_after_capture()
        owner.chooser.begin("k", 10)
        now[0] += 1.0
        owner.graphs.captured += captured
    owner.spoil_after_capture()
    owner.chooser.begin("k", 10)
    # The first forward is untimed; the second and third are timed, and the third, which captured, is left out
    # (the fourth's time is read at the next start)
    assert owner.chooser.layouts["k"].times[False] == [1.0]
