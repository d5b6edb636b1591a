"""LoRA adapters applied WITHOUT merging, chosen per request or per row, on one set of base weights.

The base weights are never touched. Projections that read the same input form a group (q/k/v,
gate/up, o, down, lm_head), and each group's adapters are held concatenated along the rank:

    A: (R, in)         rank rows of every adapter, ordered by adapter, then by member
    B: (sum_out, R)    block-diagonal over the members, pre-scaled by alpha / r
    owner: (R,)        the adapter each rank row belongs to

so one small matmul computes the low-rank input of q, k and v at once, and one more their updates
(on a fused 16-bit base the A rows sit in the base's buffer and the shrink joins the base
product, see `projections.py`):

    uniform (every row uses adapter i):  delta = (x A_i^T) B_i^T     A_i, B_i: adapter i's span
    mixed (row b chooses its adapter):   delta = ((x A^T) * g) B^T,  g[b, j] = rows[b, owner[j]]

`rows` is a (batch, n_adapters) 0/1 matrix; an all-zero row gets the base model exactly (0 times
a finite value is 0). Base and fine-tuned answers can therefore come from one batch on one
loaded model, which is what the studio's side-by-side view needs.

The bank owns copies of the adapter matrices (in the model's dtype, at fixed addresses so
captured CUDA graphs stay valid). `sync()` refreshes them from PEFT's parameters; the generator
calls it at the start of every request, so GRPO rollouts see the latest trained weights (the copy
is tiny: r=16 on every linear of an 8B model is 84 MB).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.errors import KestrelError
from kestrel.model.safe_weights import refuse_pickled

BASE = None  # `adapter=None` selects the base model


class AdapterError(KestrelError, ValueError):
    """An adapter that cannot be applied unmerged here (DoRA, LoRA bias, unknown name...)."""


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer: it carries `lora_A` / `lora_B` ModuleDicts and a `base_layer`."""
    return hasattr(module, "lora_A") and hasattr(module, "lora_B") and hasattr(module, "base_layer")


def _check_supported(layer: nn.Module, name: str) -> None:
    if getattr(layer, "use_dora", {}).get(name, False):
        raise AdapterError(f"adapter {name!r} uses DoRA, which the decode path does not apply unmerged")
    if getattr(layer, "lora_bias", {}).get(name, False):
        raise AdapterError(f"adapter {name!r} has a LoRA bias, which the decode path does not support")
    if name in getattr(layer, "lora_variant", {}):
        raise AdapterError(f"adapter {name!r} is a LoRA variant the decode path does not support")
    if not isinstance(layer.lora_A[name], nn.Linear):
        raise AdapterError(f"adapter {name!r}: only linear LoRA layers are supported")


@dataclass(frozen=True)
class LoraCall:
    """Which adapters a compiled step applies: `index` for uniform mode, else per-row `rows`."""

    index: int | None  # adapter index shared by every row; None = mixed mode (use `rows`)
    rows: torch.Tensor | None = None  # (B, n_adapters) in the model dtype, mixed mode only


def _expand(u: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """u (B, T, R) @ b (out, R)^T -> (B, T, out).

    In a compiled one-token step it is written as a length-R reduction, which the compiler
    fuses into the kernel that consumes the projection's output (RoPE, SiLU * up, the
    residual add): one small kernel launch fewer per group, which is most of an unmerged
    adapter's cost at batch 1. Elsewhere (prefill, eager) a matmul.
    """
    if torch.compiler.is_compiling() and u.shape[1] == 1:
        return (u[..., None, :] * b).sum(-1)
    return F.linear(u, b)


@dataclass
class _Source:
    lora_a: nn.Module
    lora_b: nn.Module
    scale: float
    ranks: tuple[int, int]  # rank rows [lo, hi) in the group
    outs: tuple[int, int]  # output rows [lo, hi) in the group


@dataclass
class LoraGroup:
    """The adapters of projections sharing one input (see the module docstring)."""

    a: torch.Tensor  # (R, in)
    b: torch.Tensor  # (sum_out, R), block-diagonal, pre-scaled
    owner: torch.Tensor  # (R,) long
    spans: dict[int, tuple[int, int]]  # adapter index -> its rank rows [lo, hi)
    sources: list[_Source] = field(default_factory=list)

    def span(self, call: LoraCall) -> tuple[int, int] | None:
        """The rank rows [lo, hi) a call reads: its adapter's (uniform), all (mixed), None = skip."""
        if call.index is not None:
            return self.spans.get(call.index)
        return 0, self.a.shape[0]

    def expand(self, u: torch.Tensor, call: LoraCall, lo: int, hi: int) -> torch.Tensor:
        """u (B, T, hi - lo) = x A[lo:hi]^T -> the update (B, T, sum_out)."""
        if call.index is not None:
            return _expand(u, self.b[:, lo:hi])
        gate = call.rows[:, self.owner]  # (B, R): 1 where row b uses the rank row's adapter
        return _expand(u * gate[:, None, :], self.b)

    def delta(self, x: torch.Tensor, call: LoraCall) -> torch.Tensor | None:
        """x (B, T, in) -> (B, T, sum_out), or None when the chosen adapter skips this group."""
        span = self.span(call)
        if span is None:
            return None
        lo, hi = span
        return self.expand(F.linear(x, self.a[lo:hi]), call, lo, hi)  # shrink: (B, T, hi - lo)

    @torch.no_grad()
    def sync(self) -> None:
        for src in self.sources:
            (r0, r1), (o0, o1) = src.ranks, src.outs
            self.a[r0:r1].copy_(src.lora_a.weight)
            self.b[o0:o1, r0:r1].copy_(src.lora_b.weight)
            self.b[o0:o1, r0:r1].mul_(src.scale)


def adapter_names(layers: Sequence[nn.Module]) -> list[str]:
    """Every adapter name found on PEFT LoRA layers, in order of first appearance."""
    names: list[str] = []
    for layer in layers:
        for name in layer.lora_A.keys():
            if name not in names:
                names.append(name)
    return names


def build_group(
    members: Sequence[nn.Module], out_sizes: Sequence[int], names: list[str], dtype: torch.dtype, device: torch.device
) -> LoraGroup | None:
    """The LoRA group for `members` (HF modules sharing an input), None when none carries LoRA."""
    out_lo = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
    plan: list[tuple[int, int, nn.Module, str]] = []  # (adapter index, member, layer, name)
    for idx, name in enumerate(names):
        for m, layer in enumerate(members):
            if is_lora_layer(layer) and name in layer.lora_A:
                _check_supported(layer, name)
                plan.append((idx, m, layer, name))
    if not plan:
        return None
    sources, spans, owner, lo = [], {}, [], 0
    in_features = plan[0][2].lora_A[plan[0][3]].weight.shape[1]
    for idx, m, layer, name in plan:
        r = layer.lora_A[name].weight.shape[0]
        start = spans.get(idx, (lo, lo))[0]
        spans[idx] = (start, lo + r)
        sources.append(_Source(layer.lora_A[name], layer.lora_B[name], float(layer.scaling[name]), (lo, lo + r),
                               (out_lo[m], out_lo[m] + out_sizes[m])))
        owner += [idx] * r
        lo += r
    group = LoraGroup(
        a=torch.zeros((lo, in_features), dtype=dtype, device=device),
        b=torch.zeros((sum(out_sizes), lo), dtype=dtype, device=device),
        owner=torch.tensor(owner, dtype=torch.long, device=device),
        spans=spans,
        sources=sources,
    )
    group.sync()
    return group


def selection_rows(names: Sequence[str], adapters: Sequence[str | None]) -> torch.Tensor:
    """Per-row choices (a name, or None for the base model) -> (B, n_adapters) 0/1, on the host."""
    out = torch.zeros((len(adapters), max(1, len(names))), dtype=torch.float32)
    for i, name in enumerate(adapters):
        if name is BASE:
            continue
        if name not in names:
            raise AdapterError(f"unknown adapter {name!r} (loaded: {', '.join(names) or 'none'})")
        out[i, list(names).index(name)] = 1.0
    return out


def load_adapter(model: nn.Module, path: str | Path, name: str = "default") -> nn.Module:
    """Attach the PEFT adapter saved in folder `path` to `model`, unmerged; returns the PEFT model.

    `model` may already be a PeftModel (the adapter is added beside the others) or a plain
    causal LM (it is wrapped). The base weights are shared, never copied or merged.
    """
    from peft import PeftModel

    folder = Path(path).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise AdapterError(f"{folder} is not a LoRA adapter folder (no adapter_config.json)")
    refuse_pickled(folder)
    if isinstance(model, PeftModel):
        if name in model.peft_config:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        model.load_adapter(str(folder), adapter_name=name, is_trainable=False)
        return model
    return PeftModel.from_pretrained(model, str(folder), adapter_name=name, is_trainable=False)
