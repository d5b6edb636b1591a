"""Mixture-of-experts blocks on the fast path: the sparse MLP's forward and the router's
load-balancing loss.

The block's forward (`make_moe_forward`) keeps the family's own router (it is small, and its
rounding is the family's), then runs the experts as one routed, grouped product
(`kestrel.kernels.moe.moe_experts`) with PEFT's per-expert LoRA factors read as factors: LoRA on
experts is PEFT's `target_parameters` (`lora.ParamWrapper`), so the saved adapter is a standard
PEFT folder. Anything the grouped path does not compute as PEFT would (several active adapters,
a merged or disabled adapter stays exact: base weights only) goes to PEFT's own forward.
Under QLoRA the experts' weights are NF4 (`kestrel.model.expert_quant`): the grouped product
dequantizes them one projection at a time; PEFT's own forward cannot read them and refuses.

The load-balancing (auxiliary) loss is Switch Transformer's, as HF's `load_balancing_loss_func`:
    aux = E * sum_e f_e P_e,   f_e = share of top-k choices that picked e,
                               P_e = mean router probability of e (softmax over all E logits),
both over every MoE layer's tokens (padding excluded). `RouterStats` sums them layer by layer
during one forward; the decoder stack creates one per forward and the causal-LM head reads it.
A family whose decoder stack stays HF's (Qwen3.5-MoE, for its linear attention) has HF record
the routers' logits instead, and the head sums those (`router_stats_from_logits`).

Qwen3.5-MoE's block also runs a shared expert on every token (`MoeSpec.shared_expert`):
    out = sum_k w_k expert_k(x) + sigmoid(x W_gate) * shared_expert(x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from kestrel.kernels.moe import ExpertProjection, moe_experts
from kestrel.model.expert_quant import packed_experts
from kestrel.model.registry import FamilySpec, MoeSpec

# How the head hands the decoder stack, and the stack each layer, the forward's `RouterStats`
ROUTER_STATS_KWARG = "kestrel_router_stats"


class RouterStats:
    """One forward's sums for the load-balancing loss (HF's reductions, accumulated per layer)."""

    def __init__(self, num_experts: int, top_k: int, mask: torch.Tensor | None) -> None:
        self.num_experts, self.top_k = num_experts, top_k
        self.mask = None if mask is None else mask.reshape(-1).float()  # (B*T,) 1 = real token
        self.chosen: torch.Tensor | None = None  # (E,) top-k choices per expert
        self.probs: torch.Tensor | None = None  # (E,) summed router probabilities
        self.rows: torch.Tensor | float = 0.0

    def add(self, logits: torch.Tensor) -> None:
        """logits (N, E) of one MoE layer's router, N = B*T tokens."""
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
        picked = torch.topk(probs, self.top_k, dim=-1).indices.reshape(-1)  # (N*k,)
        if self.mask is None:
            chosen = torch.bincount(picked, minlength=self.num_experts).float()
            summed, rows = probs.sum(0), float(probs.shape[0])
        else:
            weight = self.mask.to(probs.device)
            chosen = probs.new_zeros(self.num_experts).scatter_add_(0, picked, weight.repeat_interleave(self.top_k))
            summed, rows = (probs * weight.unsqueeze(-1)).sum(0), weight.sum()
        self.chosen = chosen if self.chosen is None else self.chosen + chosen
        self.probs = summed if self.probs is None else self.probs + summed
        self.rows = self.rows + rows

    @property
    def empty(self) -> bool:
        """No layer has added its router's sums (the forward ran no patched sparse block)."""
        return self.chosen is None

    def loss(self) -> torch.Tensor | None:
        """The auxiliary loss over the layers added so far (None before any)."""
        if self.chosen is None or self.probs is None:
            return None
        return self.num_experts * torch.sum((self.chosen / self.rows) * (self.probs / self.rows))


@dataclass
class MoeStackOutput(BaseModelOutputWithPast):
    """The decoder stack's output plus the forward's router sums."""

    router_stats: Any = None


def router_stats_for(config: Any, spec: FamilySpec, attention_mask: torch.Tensor | None) -> RouterStats | None:
    """A fresh `RouterStats` for one forward of a MoE family (None for a dense one)."""
    if spec.moe is None:
        return None
    return RouterStats(getattr(config, spec.moe.num_experts_attr), config.num_experts_per_tok, attention_mask)


def router_stats_from_logits(
    config: Any, spec: FamilySpec, attention_mask: torch.Tensor | None, router_logits: tuple[torch.Tensor, ...] | None,
) -> RouterStats | None:
    """The sums of `RouterStats` from the router logits (N, E) of each MoE layer that HF's own
    decoder stack recorded (`output_router_logits`), for a family whose stack is HF's."""
    stats = router_stats_for(config, spec, attention_mask)
    if stats is None or not router_logits:
        return None
    for logits in router_logits:
        stats.add(logits)
    return stats


# --- PEFT's per-expert LoRA, read as factors -------------------------------------------------


def expert_wrappers(experts: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
    """(the experts module under PEFT's nested `ParamWrapper`s, wrapper of each parameter name)."""
    found: dict[str, nn.Module] = {}
    while hasattr(experts, "parameter_name") and hasattr(experts, "lora_A"):
        found[experts.parameter_name] = experts
        experts = experts.base_layer
    return experts, found


def _factors(wrapper: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float] | None | bool:
    """(A (E, in, r), B (E, r, out), scaling) of the wrapper's active adapter; None when the
    adapter does not apply now (disabled or merged: base weights are what PEFT computes too);
    False when the grouped path cannot compute what PEFT does (several adapters, a bias...)."""
    if wrapper.disable_adapters or wrapper.merged:
        return None
    active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if len(active) != 1 or wrapper.lora_B[active[0]].bias is not None:
        return False
    a, b, scaling = adapter_factors(wrapper, active[0])
    # B made contiguous (a small copy): torch's grouped GEMM needs a unit stride in one of the
    # last two dimensions, and PEFT's column order gives B none.
    return a.to(dtype), b.contiguous().to(dtype), scaling


def adapter_factors(wrapper: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A (E, in, r), B (E, r, out), scaling) of adapter `name` on a PEFT parameter wrapper, as views
    of its parameters: y_e = x W_e + scaling * (x A_e) B_e."""
    experts = wrapper.num_experts
    a = wrapper.lora_A[name].weight  # (E*r, in), row e*r + i
    b = wrapper.lora_B[name].weight  # (out, r*E), column i*E + e
    a = a.reshape(experts, -1, a.shape[-1]).transpose(1, 2)  # (E, in, r)
    b = b.reshape(b.shape[0], -1, experts).permute(2, 1, 0)  # (E, r, out)
    return a, b, float(wrapper.scaling[name])


def expert_projections(experts: nn.Module, moe: MoeSpec) -> tuple[ExpertProjection, ExpertProjection] | None:
    """(gate_up, down) of `experts` (PEFT-wrapped or not) for the grouped product, or None when
    PEFT's own forward must run. NF4 experts (`kestrel.model.expert_quant`) come as their packed form."""
    base, wrappers = expert_wrappers(experts)
    packed = packed_experts(base)
    out = []
    for name in ("gate_up_proj", "down_proj"):
        stored = getattr(base, name)
        weight = packed.get(name) or (stored if moe.transposed else stored.transpose(1, 2))  # (E, in, out)
        bias = getattr(base, f"{name}_bias") if moe.bias else None
        factors = _factors(wrappers[name], stored.dtype) if name in wrappers else None
        if factors is False:
            return None
        a, b, s = factors if factors else (None, None, 1.0)
        out.append(ExpertProjection(weight, bias, a, b, s))
    return out[0], out[1]


def make_moe_forward(spec: FamilySpec) -> Callable[..., Any]:
    """The sparse block's forward: the family's router, then the grouped expert product."""
    moe = spec.moe
    assert moe is not None

    def forward(self: nn.Module, hidden_states: torch.Tensor, router_stats: RouterStats | None = None) -> Any:
        shape = hidden_states.shape  # (B, T, H)
        x = hidden_states.reshape(-1, shape[-1])  # (N, H)
        logits, weights, index = getattr(self, moe.router_attr)(x)  # (N, E), (N, k), (N, k)
        if router_stats is not None:
            router_stats.add(logits)
        projections = expert_projections(self.experts, moe)
        if projections is None:
            out = self.experts(x, index, weights)
        else:
            base = expert_wrappers(self.experts)[0]
            out = moe_experts(
                x, index, weights, *projections, activation=moe.activation,
                alpha=getattr(base, "alpha", 1.702), limit=getattr(base, "limit", 7.0),
            )
        if moe.shared_expert:  # every token also runs the shared expert, scaled by its own gate
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # (N, H)
        out = out.reshape(shape)
        return (out, weights) if moe.returns_scores else out

    forward.takes_router_stats = True  # type: ignore[attr-defined]
    return forward
