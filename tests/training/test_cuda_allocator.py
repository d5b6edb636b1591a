"""`performance.cuda_allocator`: how a run sets torch's CUDA caching allocator (`kestrel.training.cuda_allocator`)."""

from __future__ import annotations

import os

import pytest
import torch

from kestrel.config import PerformanceSettings, config_from_dict
from kestrel.errors import ConfigError
from kestrel.training.cuda_allocator import TORCH_VARIABLES, apply_cuda_allocator


def _cuda(monkeypatch: pytest.MonkeyPatch, available: bool, started: bool, setter=None) -> None:
    """CUDA as the test says, torch's runtime setter `setter` (None: this torch has none); torch's variables
    unset, and restored afterwards (what the function may set too)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", setter, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", None, raising=False)
    for name in TORCH_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_default_is_expandable_and_other_values_are_refused() -> None:
    assert PerformanceSettings().cuda_allocator == "expandable"
    assert config_from_dict({"performance": {"cuda_allocator": "fixed"}}).performance.cuda_allocator == "fixed"
    with pytest.raises(ConfigError, match="performance.cuda_allocator must be one of expandable, fixed"):
        config_from_dict({"performance": {"cuda_allocator": "growing"}})


@pytest.mark.parametrize("started", [False, True])
def test_the_runtime_setter_carries_the_setting_before_or_after_cuda_starts(
    monkeypatch: pytest.MonkeyPatch, started: bool,
) -> None:
    got: list[str] = []
    _cuda(monkeypatch, available=True, started=started, setter=got.append)
    assert apply_cuda_allocator("expandable") == "expandable segments"
    assert apply_cuda_allocator("fixed") == "fixed segments"
    assert got == ["expandable_segments:True", "expandable_segments:False"]
    assert not any(name in os.environ for name in TORCH_VARIABLES)  # nothing left for child processes to misread


def test_a_refusal_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(setting: str) -> None:
        raise RuntimeError("not supported on this platform")

    _cuda(monkeypatch, available=True, started=True, setter=refuse)
    assert "refused (not supported on this platform)" in apply_cuda_allocator("expandable")


def test_without_a_setter_torchs_variable_carries_it_until_cuda_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, available=True, started=False)
    assert apply_cuda_allocator("expandable") == "expandable segments (through PYTORCH_CUDA_ALLOC_CONF)"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")  # the user's other options stay
    assert apply_cuda_allocator("fixed").startswith("fixed segments")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256,expandable_segments:False"
    _cuda(monkeypatch, available=True, started=True)
    assert "cannot change them (expandable asked)" in apply_cuda_allocator("expandable")


@pytest.mark.parametrize("name", TORCH_VARIABLES)
def test_the_users_own_expandable_setting_wins(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    _cuda(monkeypatch, available=True, started=True, setter=lambda s: pytest.fail("set over the user's"))
    monkeypatch.setenv(name, "expandable_segments:False")
    assert apply_cuda_allocator("expandable") == f"as {name} sets it (expandable_segments:False)"


def test_without_cuda_nothing_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, available=False, started=False, setter=lambda s: pytest.fail("set without CUDA"))
    assert apply_cuda_allocator("expandable") == "no CUDA device: nothing to set"
    assert not any(name in os.environ for name in TORCH_VARIABLES)


_APPLIED = """
import torch
from kestrel.training.cuda_allocator import apply_cuda_allocator

print(apply_cuda_allocator({mode!r}))
x = torch.zeros(1 << 22, device="cuda")
snapshot = torch.cuda.memory._snapshot()
settings = snapshot.get("allocator_settings") if isinstance(snapshot, dict) else None
print("EXPANDABLE", None if settings is None else settings.get("expandable_segments"))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("mode, expected", [("expandable", "True"), ("fixed", "False")])
def test_the_allocator_runs_as_set(mode: str, expected: str) -> None:
    import subprocess
    import sys
    from pathlib import Path

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = {k: v for k, v in os.environ.items() if k not in TORCH_VARIABLES}
    done = subprocess.run([sys.executable, "-c", _APPLIED.format(mode=mode)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout.split("EXPANDABLE ")[-1].strip()
    if said == "None":
        pytest.skip("this torch's memory snapshot does not give its allocator settings")
    assert said == expected, done.stdout
