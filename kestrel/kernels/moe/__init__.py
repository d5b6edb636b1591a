"""Mixture-of-experts kernels: the grouped expert product (`grouped`) and the routed expert MLP
with per-expert LoRA factors (`experts`). Nothing here imports `transformers`."""

from kestrel.kernels.moe.experts import ExpertProjection, Routing, gpt_oss_glu, moe_experts
from kestrel.kernels.moe.grouped import GroupedMM, grouped_impl, grouped_mm

__all__ = ["ExpertProjection", "GroupedMM", "Routing", "gpt_oss_glu", "grouped_impl", "grouped_mm", "moe_experts"]
