"""Suite-wide settings (Triton's interpreter on machines without CUDA, the `gpu` marker, a private
KESTREL_HOME for every test session) and the fixtures many rooms share: tiny models of each
family saved as local folders, fake pinned memory."""

from __future__ import annotations

import inspect
import os
import tempfile

# Triton reads TRITON_INTERPRET when it is first imported, so this must run before any test
# module imports `kestrel.kernels`. On a GPU machine the compiled kernels run instead.
if os.environ.get("KESTREL_TEST_CUDA", "auto") == "off" or not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KESTREL_HOME", tempfile.mkdtemp(prefix="kestrel-test-home-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import mmap  # noqa: E402
from pathlib import Path  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from kestrel.recompute import host_memory  # noqa: E402
from kestrel.recompute.host_memory import _PinnedPool  # noqa: E402
from kestrel.paths import ASSETS  # noqa: E402
from tests.support.tiny import tiny_model  # noqa: E402
from tests.support.real_vocab import RealVocab, VocabMissing, real_tokenizer  # noqa: E402
from tests.support.solo import run_turns  # noqa: E402

MAX_WORKERS = 4  # `-n auto` (pyproject): one worker per core, at most this many (each loads torch)
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:  # the workers share the cores: OpenMP threads beyond them would spin against each other
    torch.set_num_threads(max(1, _CORES // _WORKERS))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: end-to-end runs of a minute or more")
    config.addinivalue_line("markers", "browser: drives a real Chromium")
    config.addinivalue_line("markers", "solo: runs while no other test runs (its timings are asserted)")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(MAX_WORKERS, _CORES))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under xdist, a `solo` test (with its fixtures' setup and teardown) runs alone: tests.support.solo."""
    turns = run_turns()
    if turns is None:
        return (yield)
    with turns.turn(item.get_closest_marker("solo") is not None):
        return (yield)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Files with a slow test first (each keeps its own order): the parallel workers then finish
    # together, not with one of them running a long file alone at the end.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _hf_linear_attention_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """With flash-linear-attention installed, HF's Qwen3.5 and Qwen3.5-MoE call its CUDA-only kernels
    on the CPU too (bound at import); the unpatched HF twins in CPU tests run HF's own PyTorch functions."""
    if torch.cuda.is_available():
        return
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    for module in (modeling_qwen3_5, modeling_qwen3_5_moe):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            monkeypatch.setattr(module, name, inspect.unwrap(getattr(module, name)))


# --- Tiny models of each family saved as local folders; fake pinned memory -------------------


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


@pytest.fixture(scope="session")
def real_vocab():
    """`real_vocab(name)` -> a `RealVocab` of llama.cpp's vocabulary `name` (tests.support.real_vocab.VOCABS),
    loaded once per session; the test is skipped when ./install.sh has not fetched the files."""
    made: dict[str, RealVocab] = {}

    def get(name: str) -> RealVocab:
        if name not in made:
            try:
                made[name] = real_tokenizer(name)
            except VocabMissing as exc:
                pytest.skip(str(exc))
        return made[name]

    return get


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
