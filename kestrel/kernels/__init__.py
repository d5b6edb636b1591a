"""Kestrel's fused kernels: Triton forward and hand-written backward passes, each with a plain
PyTorch reference that runs on the CPU and in tests. Nothing here imports `transformers`.

Each op picks its implementation through `kestrel.kernels.dispatch.backend` (Triton on CUDA, the
reference elsewhere, `KESTREL_KERNELS=triton|torch` to force one). The fused-LoRA pieces live
in `lora/`, the decode step's kernels in `decode/`, the mixture-of-experts grouped product (torch's
grouped GEMM or a padded `bmm`, not Triton) in `moe/`.
"""

from kestrel.kernels.cross_entropy import chunked_token_logprobs, fused_linear_cross_entropy
from kestrel.kernels.dispatch import backend, use_triton
from kestrel.kernels.glu import geglu, swiglu
from kestrel.kernels.lora.lora import (
    LoRAWeights, lora_linear, lora_linear_known, lora_projections, lora_projections_known, lora_qkv,
)
from kestrel.kernels.lora.mlp import lora_mlp
from kestrel.kernels.rms_norm import rms_norm
from kestrel.kernels.rope import rope_
from kestrel.kernels.short_conv import short_conv

__all__ = [
    "backend",
    "use_triton",
    "rms_norm",
    "rope_",
    "short_conv",
    "swiglu",
    "geglu",
    "fused_linear_cross_entropy",
    "chunked_token_logprobs",
    "LoRAWeights",
    "lora_linear",
    "lora_linear_known",
    "lora_projections",
    "lora_projections_known",
    "lora_mlp",
    "lora_qkv",
]
