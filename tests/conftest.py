"""Suite-wide settings: Triton's interpreter on machines without CUDA, the `gpu` marker, and a
private KESTREL_HOME for every test session."""

from __future__ import annotations

import os
import tempfile

# Triton reads TRITON_INTERPRET when it is first imported, so this must run before any test
# module imports `kernels`. On a GPU machine the compiled kernels run instead.
if os.environ.get("KESTREL_TEST_CUDA", "auto") == "off" or not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KESTREL_HOME", tempfile.mkdtemp(prefix="kestrel-test-home-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: end-to-end runs of a minute or more")
    config.addinivalue_line("markers", "browser: drives a real Chromium")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
