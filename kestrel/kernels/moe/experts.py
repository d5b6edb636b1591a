"""A mixture-of-experts MLP over routed tokens: sort by expert, two grouped products, combine.

    out[t] = sum_j  w[t, j] * down_e( act( gate_up_e(x[t]) ) ),   e = index[t, j], j < k

Each projection p of expert e is  y = x W_e (+ b_e) (+ s (x A_e) B_e)  with the LoRA factors
A (E, in, r), B (E, r, out) kept as factors: the low-rank update is two more grouped products of
rank r, so no (E, in, out) weight update is ever formed (PEFT's parameter wrapper forms one per
projection per forward). Gradients of A and B come from `GroupedMM`'s backward:
    dB_e = (x A_e)^T (s dy)_e,   dA_e = x_e^T ((s dy) B_e^T)
rank-first, again without a full-size weight gradient.

Activations (`Activation`): "swiglu" on [gate | up] halves (Qwen3-MoE, Qwen3.5-MoE), and
"gpt_oss" on interleaved gate/up columns with gpt-oss's clamps:
    g = min(gate, L), u = clamp(up, -L, L),  act = (u + 1) * g * sigmoid(alpha g)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kestrel.kernels.glu import swiglu
from kestrel.kernels.moe.grouped import Impl, grouped_mm
from kestrel.kernels.moe.nf4_experts import PackedExperts, nf4_grouped_mm

Activation = Literal["swiglu", "gpt_oss"]


@dataclass(frozen=True)
class Routing:
    """Where each (token, choice) pair goes once the pairs are sorted by expert.

    Pairs are the flattened (N, k) choices, pair p = token * k + j."""

    order: torch.Tensor  # (N*k,) pair index of each sorted row (stable: tokens keep their order)
    tokens: torch.Tensor  # (N*k,) token of each sorted row
    experts: torch.Tensor  # (N*k,) expert of each sorted row
    offsets: torch.Tensor  # (E,) int32: end of each expert's rows; empty experts repeat the previous end

    @staticmethod
    def of(index: torch.Tensor, num_experts: int) -> Routing:
        """index (N, k) expert choices -> the sorted layout. No host sync."""
        flat = index.reshape(-1)
        experts, order = torch.sort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        return Routing(order, order // index.shape[-1], experts, counts.cumsum(0).to(torch.int32))


@dataclass(frozen=True)
class ExpertProjection:
    """One projection of every expert, as the grouped product reads it."""

    weight: torch.Tensor | PackedExperts  # (E, in, out), any strides (a transposed view of (E, out, in) storage),
    # or frozen NF4 experts dequantized inside the product (QLoRA)
    bias: torch.Tensor | None = None  # (E, out)
    lora_a: torch.Tensor | None = None  # (E, in, r)
    lora_b: torch.Tensor | None = None  # (E, r, out)
    scaling: float = 1.0

    def __call__(self, xs: torch.Tensor, routing: Routing, impl: Impl = "auto") -> torch.Tensor:
        """xs (N*k, in) sorted rows -> (N*k, out), in the weight's dtype."""
        if isinstance(self.weight, PackedExperts):
            y = nf4_grouped_mm(xs, self.weight, routing.offsets, impl)
        else:
            y = grouped_mm(xs, self.weight, routing.offsets, impl)
        if self.bias is not None:
            y = y + self.bias[routing.experts]
        if self.lora_a is not None and self.lora_b is not None:
            low = grouped_mm(xs, self.lora_a, routing.offsets, impl)  # (N*k, r)
            y = y + self.scaling * grouped_mm(low, self.lora_b, routing.offsets, impl)
        return y


def gpt_oss_glu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """h (..., 2I) with gate/up interleaved -> (..., I), gpt-oss's clamped GLU."""
    gate = h[..., ::2].clamp(max=limit)
    up = h[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _activate(h: torch.Tensor, activation: Activation, alpha: float, limit: float) -> torch.Tensor:
    if activation == "gpt_oss":
        return gpt_oss_glu(h, alpha, limit)
    gate, up = h.chunk(2, dim=-1)
    return swiglu(gate, up)


def moe_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    gate_up: ExpertProjection,
    down: ExpertProjection,
    activation: Activation = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    impl: Impl = "auto",
) -> torch.Tensor:
    """x (N, H) tokens, index (N, k) chosen experts, weights (N, k) their routing weights -> (N, H).

    The k contributions of a token are summed by a reshape and a sum (deterministic, unlike an
    `index_add_` of duplicate indices on CUDA), in x's dtype as HF does."""
    n, hidden = x.shape
    k = index.shape[-1]
    routing = Routing.of(index, gate_up.weight.shape[0])
    xs = x[routing.tokens]  # (N*k, H)
    h = _activate(gate_up(xs, routing, impl), activation, alpha, limit)  # (N*k, I)
    out = down(h, routing, impl) * weights.reshape(-1)[routing.order].unsqueeze(-1)  # (N*k, H)
    unsorted = torch.empty_like(out).index_copy_(0, routing.order, out)  # back to pair order
    return unsorted.view(n, k, hidden).sum(dim=1).to(x.dtype)
