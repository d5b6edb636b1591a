"""Fused base projections for decoding, WITHOUT a second copy of the model's weights.

Why: decoding one token reads every weight once. Q, K and V (and gate and up) read the same
input; as separate products the small ones (k_proj, v_proj) reach poor bandwidth and the input
is read several times. One (q + k + v, hidden) and one (2 * intermediate, hidden) product per
layer fix both.

Design: re-point, do not copy. `FusedWeight(members, extra)` allocates one buffer (weight
`(sum_out + extra, in)`; bias `(sum_out + extra,)`, zeros where a member has none, or None),
copies the members' weights in and sets each member's `weight.data` (and `bias.data`) to its
contiguous row slice; the old storage is freed. The modules keep their Parameters, so training,
PEFT and optimizers see ordinary parameters and in-place writes land in the buffer. The `extra`
rows hold the LoRA bank's A matrices (`projections.py`), so one product gives the base outputs
and the adapters' low-rank inputs together. A concatenated copy was rejected: about 70% of the
model again, memory the studio's next model needs, and stale after every training step.

When (`fuse_allowed`): the members' weights are frozen (LoRA, GRPO rollouts: fusing only
inference-only loads would miss the rollouts) or the model is in eval mode (`python -m kestrel
chat`, the studio); never a model in train mode with trainable base weights. Only plain floating
`nn.Linear` weights fuse: not NF4 bases, tied parameters or accelerate-offloaded modules.

What could break it: a member's storage replaced (`model.to()`, PEFT's safe merge,
`load_state_dict(assign=True)`) is found by `repair()` before every request, which copies the new
values into the buffer (whose address captured CUDA graphs keep) and re-points; when shape,
dtype or device changed, the caller drops fusion for that group. Saving a whole live model needs `unfuse()` first
(`Generator.close()`; `save_pretrained` would copy the shared views, safetensors' `save_model`
refuses them); adapter saves and exports never read the live buffer. Callers empty the CUDA cache
after each layer, since the allocator cannot give the members' freed blocks to the fused buffers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class _Member:
    module: nn.Linear
    lo: int  # rows [lo, hi) of the buffer
    hi: int


def tied_parameters(model: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one name (tied embeddings, shared layers)."""
    counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {pid for pid, n in counts.items() if n > 1}


def fusable(members: Sequence[nn.Module], tied: set[int]) -> str:
    """Why `members` cannot share one buffer ("" when they can)."""
    first = members[0]
    for m in members:
        if not isinstance(m, nn.Linear) or type(getattr(m, "weight", None)) is not nn.Parameter:
            return f"{type(m).__name__} is not a plain nn.Linear"
        w = m.weight
        if type(w.data) is not torch.Tensor or not w.dtype.is_floating_point or w.device.type == "meta":
            return f"{type(m).__name__} weight is {w.dtype} on {w.device}"
        if hasattr(m, "_hf_hook"):
            return "offloaded module (accelerate hook)"
        if (w.dtype, w.device, w.shape[1]) != (first.weight.dtype, first.weight.device, first.weight.shape[1]):
            return "members differ in dtype, device or input size"
        if id(w) in tied or (m.bias is not None and id(m.bias) in tied):
            return "a tied parameter"
        if m.bias is not None and (type(m.bias) is not nn.Parameter or m.bias.dtype != w.dtype):
            return "an unusual bias"
    return ""


def fuse_allowed(members: Sequence[nn.Module], model: nn.Module, setting: bool | None) -> bool:
    """`setting` True/False forces; None (auto): frozen weights, or a model in eval mode."""
    if setting is not None:
        return setting
    frozen = not any(p.requires_grad for m in members for p in m.parameters(recurse=False))
    return frozen or not model.training


class FusedWeight:
    """One buffer for the weights (and biases) of `members`, plus `extra` zeroed rows after them."""

    def __init__(self, members: Sequence[nn.Linear], extra: int = 0) -> None:
        w0 = members[0].weight
        sizes = [m.weight.shape[0] for m in members]
        self.n = sum(sizes)  # base rows
        self.sizes = sizes
        self.weight: torch.Tensor = torch.empty((self.n + extra, w0.shape[1]), dtype=w0.dtype, device=w0.device)
        self.weight[self.n :].zero_()
        has_bias = any(m.bias is not None for m in members)
        self.bias: torch.Tensor | None = (
            torch.zeros(self.n + extra, dtype=w0.dtype, device=w0.device) if has_bias else None
        )
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.members = [_Member(m, bounds[i], bounds[i + 1]) for i, m in enumerate(members)]
        for member in self.members:
            self._bind(member)

    # --- views the decode step reads ------------------------------------------------------------

    @property
    def base(self) -> torch.Tensor:
        """(sum_out, in): the members' rows only."""
        return self.weight[: self.n]

    @property
    def base_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias[: self.n]

    @property
    def extra(self) -> torch.Tensor:
        """(extra, in): the rows after the members' (the LoRA bank's A)."""
        return self.weight[self.n :]

    # --- binding --------------------------------------------------------------------------------

    @torch.no_grad()
    def _bind(self, member: _Member) -> None:
        """Copy the member's current values into its rows and point its parameters there."""
        m, lo, hi = member.module, member.lo, member.hi
        rows = self.weight[lo:hi]
        rows.copy_(m.weight)
        m.weight.data = rows
        if m.bias is not None:
            b = self.bias[lo:hi]
            b.copy_(m.bias)
            m.bias.data = b

    def _bound(self, member: _Member) -> bool:
        m = member.module
        ok = m.weight.data_ptr() == self.weight[member.lo].data_ptr()
        if m.bias is not None:
            ok = ok and self.bias is not None and m.bias.data_ptr() == self.bias[member.lo :].data_ptr()
        return ok

    def repair(self) -> bool:
        """Re-bind members whose storage was replaced; False when one no longer fits the buffer."""
        for member in self.members:
            if self._bound(member):
                continue
            m = member.module
            w = m.weight
            if (
                type(w) is not nn.Parameter
                or tuple(w.shape) != (member.hi - member.lo, self.weight.shape[1])
                or (w.dtype, w.device) != (self.weight.dtype, self.weight.device)
                or (m.bias is not None and self.bias is None)
            ):
                return False
            self._bind(member)
        return True

    @torch.no_grad()
    def unfuse(self) -> None:
        """Give every still-bound member its own storage again (a copy); drop the buffer."""
        for member in self.members:
            if not self._bound(member):
                continue
            m = member.module
            m.weight.data = m.weight.data.clone()
            if m.bias is not None:
                m.bias.data = m.bias.data.clone()
        self.members = []
        self.weight = torch.empty(0)
        self.bias = None

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
