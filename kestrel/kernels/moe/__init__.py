"""Mixture-of-experts kernels: the grouped expert product (`grouped`) and the routed expert MLP
with per-expert LoRA factors (`experts`); frozen experts in NF4 (`nf4_experts`). Nothing here imports `transformers`."""

from kestrel.kernels.moe.experts import ExpertProjection, Routing, gpt_oss_glu, moe_experts
from kestrel.kernels.moe.grouped import GroupedMM, grouped_impl, grouped_mm
from kestrel.kernels.moe.nf4_experts import NF4GroupedMM, PackedExperts, nf4_grouped_mm

__all__ = [
    "ExpertProjection", "GroupedMM", "NF4GroupedMM", "PackedExperts", "Routing", "gpt_oss_glu", "grouped_impl", "grouped_mm",
    "moe_experts", "nf4_grouped_mm",
]
