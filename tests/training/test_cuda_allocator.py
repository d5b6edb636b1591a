"""`performance.cuda_allocator`: how a run sets torch's CUDA caching allocator (`kestrel.training.cuda_allocator`)."""

from __future__ import annotations

import os

import pytest
import torch

from kestrel.config import PerformanceSettings, config_from_dict
from kestrel.errors import ConfigError
from kestrel.training.cuda_allocator import TORCH_VARIABLE, apply_cuda_allocator


def _cuda(monkeypatch: pytest.MonkeyPatch, available: bool, started: bool) -> None:
    """CUDA as the test says; torch's variable unset, and restored afterwards (what the function sets too)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started)
    monkeypatch.setenv(TORCH_VARIABLE, "")
    monkeypatch.delenv(TORCH_VARIABLE)


def test_the_default_is_expandable_and_other_values_are_refused() -> None:
    assert PerformanceSettings().cuda_allocator == "expandable"
    assert config_from_dict({"performance": {"cuda_allocator": "fixed"}}).performance.cuda_allocator == "fixed"
    with pytest.raises(ConfigError, match="performance.cuda_allocator must be one of expandable, fixed"):
        config_from_dict({"performance": {"cuda_allocator": "growing"}})


def test_before_cuda_starts_the_setting_goes_through_torchs_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, available=True, started=False)
    assert apply_cuda_allocator("expandable") == "expandable segments"
    assert os.environ[TORCH_VARIABLE] == "expandable_segments:True"
    monkeypatch.setenv(TORCH_VARIABLE, "max_split_size_mb:256")  # the user's other options stay
    assert apply_cuda_allocator("fixed") == "fixed segments"
    assert os.environ[TORCH_VARIABLE] == "max_split_size_mb:256,expandable_segments:False"


def test_the_users_own_expandable_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, available=True, started=True)
    monkeypatch.setenv(TORCH_VARIABLE, "expandable_segments:False")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: pytest.fail("set over the user's"),
                        raising=False)
    assert "expandable_segments:False" in apply_cuda_allocator("expandable")


def test_after_cuda_started_the_runtime_setter_is_used_and_its_refusal_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, available=True, started=True)
    got: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", got.append, raising=False)
    assert apply_cuda_allocator("expandable").startswith("expandable segments (set after CUDA had started")
    assert got == ["expandable_segments:True"]

    def refuse(setting: str) -> None:
        raise RuntimeError("not supported on this platform")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse, raising=False)
    assert "refused (not supported on this platform)" in apply_cuda_allocator("expandable")


def test_without_cuda_nothing_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, available=False, started=False)
    assert apply_cuda_allocator("expandable") == "no CUDA device: nothing to set"
    assert TORCH_VARIABLE not in os.environ
