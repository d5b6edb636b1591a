"""Fixtures shared by the kernel tests: the implementation to run, and NaN-poisoned allocations."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=["triton", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once through the Triton kernels (the interpreter on a CPU) and once through the
    PyTorch references, forced with KESTREL_KERNELS."""
    monkeypatch.setenv("KESTREL_KERNELS", request.param)
    return request.param


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every new float buffer starts as NaN, so an element a kernel forgets to write shows."""
    for name in ("empty", "empty_like", "empty_strided"):
        original = getattr(torch, name)

        def poisoned_alloc(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            return out.fill_(float("nan")) if out.is_floating_point() else out

        monkeypatch.setattr(torch, name, poisoned_alloc)
