"""Fixtures for engine tests: tiny models of each family saved as local folders."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from engine import host_memory
from engine.host_memory import _PinnedPool
from engine.paths import ASSETS
from engine.tiny import tiny_model


@pytest.fixture(scope="session")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "demo")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer):
    """`tiny_model_dir(family)` -> a folder holding a tiny random model and the demo tokenizer."""
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            tiny_model(family, len(demo_tokenizer), seed=0).save_pretrained(folder)
            demo_tokenizer.save_pretrained(folder)
            made[family] = folder
        return made[family]

    return make


@pytest.fixture
def fake_pinning(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Registered pointer -> registered bytes, kept by fake `cudaHostRegister`/`Unregister`; pools
    for any device (CPU included), in a fresh pool table."""
    registered: dict[int, int] = {}

    def register(ptr: int, nbytes: int) -> int:
        assert ptr % mmap.PAGESIZE == 0 and nbytes % mmap.PAGESIZE == 0 and ptr not in registered
        registered[ptr] = nbytes
        return 0

    def unregister(ptr: int) -> int:
        return 0 if registered.pop(ptr, None) is not None else 713  # cudaErrorHostMemoryNotRegistered

    pools: dict[torch.device, _PinnedPool] = {}
    monkeypatch.setattr(host_memory, "_register_host", register)
    monkeypatch.setattr(host_memory, "_unregister_host", unregister)
    monkeypatch.setattr(host_memory, "_POOLS", pools)
    monkeypatch.setattr(host_memory, "_pool_for", lambda d: pools.setdefault(d, _PinnedPool(d)))
    return registered
