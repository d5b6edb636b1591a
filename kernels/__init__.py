"""Kestrel's fused kernels: Triton forward and hand-written backward passes, each with a plain
PyTorch reference that runs on the CPU and in tests. Nothing here imports `transformers`.

Each op picks its implementation through `kernels.dispatch.backend` (Triton on CUDA, the
reference elsewhere, `KESTREL_KERNELS=triton|torch` to force one).

The public names load lazily (PEP 562). `transformers` probes for an unrelated package that is
also called `kernels` by importing it; lazy loading keeps that probe from importing Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "backend": "kernels.dispatch",
    "use_triton": "kernels.dispatch",
    "rms_norm": "kernels.rms_norm",
    "rope_": "kernels.rope",
    "swiglu": "kernels.glu",
    "geglu": "kernels.glu",
    "fused_linear_cross_entropy": "kernels.cross_entropy",
    "chunked_token_logprobs": "kernels.cross_entropy",
    "LoRAWeights": "kernels.lora",
    "lora_linear": "kernels.lora",
    "lora_mlp": "kernels.lora",
    "lora_qkv": "kernels.lora",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
