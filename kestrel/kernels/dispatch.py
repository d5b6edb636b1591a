"""One explicit choice between the Triton kernels and their PyTorch references.

Every public op in `kestrel.kernels` asks `use_triton(...)` once per call. The rule:

- `KESTREL_KERNELS=triton` forces the Triton kernels everywhere (on a CPU they run through
  Triton's interpreter, which needs `TRITON_INTERPRET=1` set before `triton` is imported);
- `KESTREL_KERNELS=torch` forces the PyTorch references everywhere;
- otherwise Triton runs on CUDA tensors and the references run on everything else.

No implementation is swapped at import time: the environment is read on each call, so tests can
flip it with `monkeypatch.setenv`.
"""

from __future__ import annotations

from typing import Literal

from kestrel import env
import torch

Backend = Literal["triton", "torch"]
_VALID = ("triton", "torch")


def forced_backend() -> Backend | None:
    """The backend named by `KESTREL_KERNELS`, or None when it is unset or empty."""
    return env.choice("KESTREL_KERNELS", {v: v for v in _VALID})  # type: ignore[return-value]


def backend(*tensors: torch.Tensor) -> Backend:
    """Which implementation runs for an op whose inputs are `tensors`."""
    forced = forced_backend()
    if forced is not None:
        return forced
    return "triton" if tensors and all(t.is_cuda for t in tensors) else "torch"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernel should run for these inputs."""
    return backend(*tensors) == "triton"
