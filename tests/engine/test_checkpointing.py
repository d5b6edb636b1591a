"""engine.checkpointing's offloaded layer inputs: copied out and back exactly, the layer below's
copy back started when a layer's backward begins, and a finished step's copies let go."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.checkpointing import LayerCheckpoint, _HostCopy


def _chain(device: str, n: int = 3, numel: int = 1000) -> tuple[list[torch.Tensor], list[_HostCopy]]:
    inputs = [torch.randn(numel, device=device) for _ in range(n)]
    return inputs, [_HostCopy(x) for x in inputs]


def _check_chain(device: str, numel: int) -> None:
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


def test_copies_come_back_exactly_in_backward_order_on_cpu() -> None:
    _check_chain("cpu", 1000)


@pytest.mark.gpu
def test_copies_come_back_exactly_on_cuda() -> None:
    # 64 MB each, with the compute stream kept busy so the side-stream copies are still running
    # when their results are asked for.
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a / 64
    _check_chain("cuda", 16 << 20)


def test_finished_copies_are_released() -> None:
    _, copies = _chain("cpu")
    below = copies[0]
    del copies, below
    gc.collect()
    fresh = _HostCopy(torch.zeros(3))
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
        h = x
        for layer in layers:
            h = LayerCheckpoint.apply(lambda t, layer=layer: torch.tanh(layer(t)), offload, h)
        x.grad = None
        for layer in layers:
            layer.zero_grad()
        h.square().sum().backward()
        grads[offload] = [x.grad.clone(), *(p.grad.clone() for l in layers for p in l.parameters())]
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
