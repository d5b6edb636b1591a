"""The sparse mixture-of-experts block in Kestrel's decode forward (Qwen3-MoE, gpt-oss).

    logits, w, e = router(x)                    the family's own router module (its math, its rounding):
        Qwen3-MoE: p = softmax(x W_r^T); (w, e) = topk(p, k); w /= sum w   (norm_topk_prob)
        gpt-oss:   (l, e) = topk(x W_r^T + b_r, k); w = softmax(l)
    out[n] = sum_j w[n, j] * down_e(act(gate_up_e(x[n])))        e = e[n, j], j < k
    proj_e(x) = x W_e (+ b_e) (+ (x A_e) B_e)                    A, B: the LoRA bank below

act: SiLU(gate) * up on [gate | up] halves (Qwen3-MoE), gpt-oss's clamped GLU on interleaved
columns (`kestrel.kernels.moe.gpt_oss_glu`). The weights are the model's own 3-D parameters in the
stored layout: (E, out, in) for Qwen3-MoE, (E, in, out) for gpt-oss (`MoeSpec.transposed`).

Two ways to run the products, by the number of tokens:
- a decode step (one token a row, N = B): one launch per projection computes every pair's
  product straight from the stored experts (`kestrel.kernels.decode.expert_gemv`), the expert
  ids read on the device. Bytes read: the chosen experts' weights as stored, once per pair
  (N*k*in*out weights; an expert chosen twice is read twice, the repeat mostly from L2), in
  16-bit or, for NF4 experts (QLoRA, `kestrel.model.expert_quant`), their packed codes and block
  scales (about 0.52 byte a weight); nothing is written but the (N*k, out) products. No host
  read, fixed shapes: the step compiles and captures. Where the Triton kernels do not run (a
  CPU without the interpreter) the chosen slices are gathered into an (N*k, in, out) copy (NF4:
  dequantized from the chosen experts' codes, `PackedExperts.select`) and multiplied by one
  batched matmul (`expert_gemv.gathered_products`).
- prefill (many tokens, most experts hit): the training path's grouped product, rows sorted by
  expert, one grouped GEMM per projection (`kestrel.kernels.moe`); NF4 experts dequantized whole,
  once per projection.

LoRA on the experts is PEFT's `target_parameters` (`lora.ParamWrapper`). `ExpertLora` holds every
adapter's factors concatenated along the rank, as `kestrel.decode.adapters.LoraGroup` does for
linears: A (E, in, R), B (E, R, out) pre-scaled by alpha / r, owner (R,). A uniform call reads its
adapter's rank span; a mixed call reads all of them and zeroes the rank columns of adapters a
row did not choose:  delta = ((x A_e) * g) B_e,  g[pair, j] = rows[row of pair, owner[j]].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from kestrel.decode.adapters import LoraCall
from kestrel.kernels.decode import expert_gemv
from kestrel.kernels.decode.expert_gemv import ExpertWeights, expert_weights
from kestrel.kernels.moe import ExpertProjection, PackedExperts, Routing, gpt_oss_glu, grouped_mm
from kestrel.model.expert_quant import packed_experts
from kestrel.model.moe import adapter_factors, expert_wrappers
from kestrel.model.registry import MoeSpec


@dataclass
class ExpertLora:
    """Every adapter's factors on one expert projection (see the module docstring)."""

    a: torch.Tensor  # (E, in, R)
    b: torch.Tensor  # (E, R, out), pre-scaled
    owner: torch.Tensor  # (R,) long: the adapter of each rank column
    spans: dict[int, tuple[int, int]]  # adapter index -> its rank columns [lo, hi)
    sources: list[tuple[nn.Module, str, tuple[int, int]]] = field(default_factory=list)  # (wrapper, name, span)

    def span(self, call: LoraCall) -> tuple[int, int] | None:
        """Rank columns a call reads: its adapter's (uniform), all (mixed), None = none here."""
        return self.spans.get(call.index) if call.index is not None else (0, self.a.shape[-1])

    @torch.no_grad()
    def sync(self) -> None:
        """Copy PEFT's current factors in (in place: captured graphs stay valid)."""
        for wrapper, name, (lo, hi) in self.sources:
            a, b, scaling = adapter_factors(wrapper, name)
            self.a[:, :, lo:hi].copy_(a)
            self.b[:, lo:hi].copy_(b)
            self.b[:, lo:hi].mul_(scaling)


def build_expert_lora(wrapper: nn.Module | None, names: list[str], dtype: torch.dtype,
                      device: torch.device) -> ExpertLora | None:
    """The bank of the adapters in `names` that `wrapper` (a PEFT ParamWrapper) carries, or None."""
    plan = [(i, name) for i, name in enumerate(names) if wrapper is not None and name in wrapper.lora_A]
    if not plan:
        return None
    spans, owner, sources, lo = {}, [], [], 0
    for index, name in plan:
        r = wrapper.lora_A[name].weight.shape[0] // wrapper.num_experts
        spans[index] = (lo, lo + r)
        sources.append((wrapper, name, (lo, lo + r)))
        owner += [index] * r
        lo += r
    a, b, _ = adapter_factors(wrapper, plan[0][1])
    bank = ExpertLora(
        a=torch.zeros((a.shape[0], a.shape[1], lo), dtype=dtype, device=device),
        b=torch.zeros((b.shape[0], lo, b.shape[2]), dtype=dtype, device=device),
        owner=torch.tensor(owner, dtype=torch.long, device=device), spans=spans, sources=sources,
    )
    bank.sync()
    return bank


@dataclass
class Experts:
    """One projection (gate_up or down) of every expert, as stored, and its LoRA bank."""

    weight: torch.Tensor  # (E, out, in), or (E, in, out) when `transposed`; a placeholder when `packed`
    packed: PackedExperts | None  # the NF4 weights (QLoRA)
    transposed: bool
    bias: torch.Tensor | None  # (E, out)
    lora: ExpertLora | None = None
    stored: ExpertWeights = field(init=False)  # what a step's products read (`expert_gemv`)

    def __post_init__(self) -> None:
        self.stored = expert_weights(self.packed if self.packed is not None else self.weight, self.transposed)

    def step(self, xs: torch.Tensor, experts: torch.Tensor, call: LoraCall | None,
             gate: torch.Tensor | None) -> torch.Tensor:
        """xs (M, in) pair rows, experts (M,) their expert, gate (M, n_adapters) for a mixed call
        -> (M, out): each pair's expert read in place (see the module docstring)."""
        y = expert_gemv.expert_products(xs, experts, self.stored)
        if self.bias is not None:
            y = y + self.bias[experts]
        span = None if call is None or self.lora is None else self.lora.span(call)
        if span is not None:
            lo, hi = span
            u = torch.bmm(xs[:, None], self.lora.a[experts, :, lo:hi])  # (M, 1, r)
            if gate is not None:
                u = u * gate[:, self.lora.owner][:, None]
            y = y + torch.bmm(u, self.lora.b[experts, lo:hi])[:, 0]
        return y

    def grouped(self, xs: torch.Tensor, routing: Routing, call: LoraCall | None,
                gate: torch.Tensor | None) -> torch.Tensor:
        """xs (M, in) pair rows sorted by expert, gate (M, n_adapters) in the same order -> (M, out)."""
        weight = self.packed if self.packed is not None else (self.weight if self.transposed else self.weight.transpose(1, 2))
        y = ExpertProjection(weight, self.bias)(xs, routing)
        span = None if call is None or self.lora is None else self.lora.span(call)
        if span is not None:
            lo, hi = span
            u = grouped_mm(xs, self.lora.a[:, :, lo:hi].contiguous(), routing.offsets)  # (M, r)
            if gate is not None:
                u = u * gate[:, self.lora.owner]
            y = y + grouped_mm(u, self.lora.b[:, lo:hi].contiguous(), routing.offsets)
        return y


@dataclass
class MoeBlock:
    """A decoder layer's sparse MLP: router, gate_up and down experts, activation."""

    router: nn.Module  # the family's router: x (N, H) -> (logits, weights (N, k), index (N, k))
    gate_up: Experts
    down: Experts
    act: Callable[[torch.Tensor], torch.Tensor]  # (M, 2I) -> (M, I)
    wrappers: dict[str, nn.Module]  # PEFT's parameter wrappers by parameter name
    module: nn.Module  # the HF sparse block it reads

    def current(self) -> bool:
        """True while the experts module still holds the weights read here (same tensors, same NF4)."""
        base = expert_wrappers(self.module.experts)[0]
        packed = packed_experts(base)
        return all(getattr(base, f"{name}_proj") is p.weight and packed.get(f"{name}_proj") is p.packed
                   for name, p in (("gate_up", self.gate_up), ("down", self.down)))

    def attach_lora(self, names: list[str], dtype: torch.dtype, device: torch.device) -> None:
        for name in ("gate_up", "down"):
            getattr(self, name).lora = build_expert_lora(self.wrappers.get(f"{name}_proj"), names, dtype, device)

    @property
    def banks(self) -> list[ExpertLora]:
        return [p.lora for p in (self.gate_up, self.down) if p.lora is not None]

    def __call__(self, h: torch.Tensor, call: LoraCall | None) -> torch.Tensor:
        """h (B, T, H) normed -> (B, T, H). T == 1 (a step) gathers; longer inputs go grouped."""
        b, t, hidden = h.shape
        x = h.reshape(-1, hidden)  # (N, H)
        _, weights, index = self.router(x)  # (N, k) each
        n, k = index.shape
        # Pair p = token * k + j, token = row * T + position: a mixed call's choices per pair.
        gate = None if call is None or call.index is not None else call.rows.repeat_interleave(t * k, dim=0)
        if t == 1:
            flat = index.reshape(-1)  # (N*k,)
            xs = x.repeat_interleave(k, dim=0)  # (N*k, H)
            y = self.down.step(self.act(self.gate_up.step(xs, flat, call, gate)), flat, call, gate)
        else:
            routing = Routing.of(index, self.gate_up.weight.shape[0])
            xs = x[routing.tokens]  # (N*k, H), sorted by expert
            gate = None if gate is None else gate[routing.order]
            y = self.down.grouped(self.act(self.gate_up.grouped(xs, routing, call, gate)), routing, call, gate)
            y = torch.empty_like(y).index_copy_(0, routing.order, y)  # back to pair order
        y = y * weights.reshape(-1, 1).to(y.dtype)  # (N*k, H)
        return y.view(n, k, hidden).sum(dim=1).to(h.dtype).view(b, t, hidden)


def is_sparse(mlp: nn.Module, moe: MoeSpec | None) -> bool:
    """True for a layer's MLP that is the family's sparse block (Qwen3-MoE's `mlp_only_layers` are dense)."""
    return moe is not None and type(mlp).__name__ == moe.block_class


def unreadable(block: nn.Module, moe: MoeSpec) -> str:
    """Why the decode block cannot read `block`'s experts ("" when it can): e.g. gpt-oss kept in
    MXFP4 blocks by Hugging Face (Kestrel's loader dequantizes them), or a shared expert."""
    if moe.shared_expert:
        return f"{moe.block_class} has a shared expert"
    base, _ = expert_wrappers(block.experts)
    packed = packed_experts(base)
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(base, name, None)
        if name not in packed and not (isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.is_floating_point()):
            return f"its experts hold no 3-D {name} (e.g. MXFP4 blocks; load with Kestrel's loader to dequantize them)"
    return ""


def moe_block(block: nn.Module, moe: MoeSpec) -> MoeBlock:
    """The decode view of a loaded sparse block (PEFT-wrapped experts or not; `unreadable` says
    "" for it); no copies."""
    base, wrappers = expert_wrappers(block.experts)
    packed = packed_experts(base)

    def projection(name: str) -> Experts:
        bias = getattr(base, f"{name}_bias") if moe.bias else None
        return Experts(getattr(base, name), packed.get(name), moe.transposed, bias)

    if moe.activation == "gpt_oss":
        alpha, limit = float(base.alpha), float(base.limit)

        def act(h: torch.Tensor) -> torch.Tensor:
            return gpt_oss_glu(h, alpha, limit)
    else:
        act_fn = base.act_fn

        def act(h: torch.Tensor) -> torch.Tensor:
            gate, up = h.chunk(2, dim=-1)
            return act_fn(gate) * up

    return MoeBlock(getattr(block, moe.router_attr), projection("gate_up_proj"), projection("down_proj"), act, wrappers,
                    block)
