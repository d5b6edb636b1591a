"""kestrel.kernels._launch: Triton's own launch for the first call of each specialisation, the compiled
kernel directly afterwards, and never a cached kernel where Triton could have picked another.

A stand-in kernel records calls (the real path needs a GPU; the GPU-marked kernel tests run it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kestrel.kernels import _launch


class FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, g0: int, g1: int, g2: int, stream: Any, fn: Any, meta: Any, lm: Any, enter: Any,
            leave: Any, *args: Any) -> None:
        self.log.append(("direct", (g0, g1, g2), args))

    def launch_metadata(self, grid: Any, stream: Any, *args: Any) -> None:
        return None


class FakeKernel:
    """Compiles once per Triton-visible specialisation; every call through [grid] is logged."""

    def __init__(self, n_params: int) -> None:
        self.params = [object()] * n_params
        self.log: list = []

    def __getitem__(self, grid: tuple[int, ...]):
        def call(*args: Any, **options: Any) -> FakeCompiled:
            self.log.append(("triton", grid, args))
            return FakeCompiled(self.log)

        return call


@pytest.fixture(autouse=True)
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 7)
    monkeypatch.setattr(_launch, "driver", SimpleNamespace(active=active))
    _launch.clear()


def _kinds(kernel: FakeKernel) -> list[str]:
    return [entry[0] for entry in kernel.log]


def test_first_call_through_triton_then_direct() -> None:
    k = FakeKernel(4)
    x, y = torch.zeros(8), torch.zeros(8)
    _launch.launch(k, (3,), x, y, 5, True, num_warps=4)
    _launch.launch(k, (3, 2), x, y, 5, True, num_warps=4)
    assert _kinds(k) == ["triton", "direct"]
    assert k.log[1][1] == (3, 2, 1) and k.log[1][2] == (x, y, 5, True)


@pytest.mark.parametrize(
    "change",
    ["dtype", "misaligned", "int value", "int vs bool", "options"],
)
def test_anything_triton_specialises_on_takes_its_path(change: str) -> None:
    k = FakeKernel(3)
    x = torch.zeros(16)
    _launch.launch(k, (1,), x, 1, 2.0, num_warps=4)
    args, options = [x, 1, 2.0], {"num_warps": 4}
    if change == "dtype":
        args[0] = torch.zeros(16, dtype=torch.float16)
    if change == "misaligned":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    if change == "int value":
        args[1] = 16
    if change == "int vs bool":
        args[1] = True
    if change == "options":
        options = {"num_warps": 8}
    _launch.launch(k, (1,), *args, **options)
    assert _kinds(k) == ["triton", "triton"]
    _launch.launch(k, (1,), *args, **options)
    assert _kinds(k) == ["triton", "triton", "direct"]


def test_partial_arguments_and_interpreted_kernels_never_cache() -> None:
    k = FakeKernel(5)  # two parameters left to their defaults: Triton must bind them
    x = torch.zeros(4)
    for _ in range(2):
        _launch.launch(k, (1,), x, 1, 2)
    assert _kinds(k) == ["triton", "triton"]

    class Interpreted(FakeKernel):
        def __getitem__(self, grid):
            inner = super().__getitem__(grid)
            return lambda *a, **o: inner(*a, **o) and None  # the interpreter returns nothing

    i = Interpreted(1)
    for _ in range(2):
        _launch.launch(i, (1,), x)
    assert _kinds(i) == ["triton", "triton"]


def test_unkeyable_argument_takes_triton_path() -> None:
    k = FakeKernel(2)
    for _ in range(2):
        _launch.launch(k, (1,), torch.zeros(4), [1, 2])
    assert _kinds(k) == ["triton", "triton"]
