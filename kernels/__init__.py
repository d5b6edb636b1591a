"""Kestrel's fused kernels: Triton forward and hand-written backward passes, each with a plain
PyTorch reference that runs on the CPU and in tests. Nothing here imports `transformers`.

Each op picks its implementation through `kernels.dispatch.backend` (Triton on CUDA, the
reference elsewhere, `KESTREL_KERNELS=triton|torch` to force one).

Note: `transformers` and `bitsandbytes` probe for an unrelated hub package that is also called
`kernels` by importing it; they find this one, see no version / no `get_kernel`, and move on.
"""

from kernels.cross_entropy import chunked_token_logprobs, fused_linear_cross_entropy
from kernels.dispatch import backend, use_triton
from kernels.glu import geglu, swiglu
from kernels.lora import LoRAWeights, lora_linear, lora_qkv
from kernels.mlp import lora_mlp
from kernels.rms_norm import rms_norm
from kernels.rope import rope_

__all__ = [
    "backend",
    "use_triton",
    "rms_norm",
    "rope_",
    "swiglu",
    "geglu",
    "fused_linear_cross_entropy",
    "chunked_token_logprobs",
    "LoRAWeights",
    "lora_linear",
    "lora_mlp",
    "lora_qkv",
]
