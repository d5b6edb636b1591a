"""The decode path's linear projections: groups of projections that read one input, their LoRA.

A `ProjGroup` is q/k/v, gate/up, o, down or lm_head. It runs one of two ways:

separate (quantized bases, full fine-tuning, lm_head):
    outs_i = x W_i^T (+ b_i)              one product per member (a module call for NF4)
    delta  = expand((x A^T) [* gate])     the LoRA bank's shrink, then its expand (adapters.py)

    NF4 bases (bitsandbytes Linear4bit) at 2-16 rows on CUDA (a decode batch) instead run ONE
    launch for the whole group (`kestrel/kernels/decode/nf4_gemv.py`: the packed weights read in
    place, no dequantized copy written), outs = split(x [W_1; ...; W_m]^T); more rows (prefill)
    call the modules, and so does one row, where bitsandbytes' 4-bit GEMV is faster (that file).

fused (`fuse()`, a 16-bit base; see fused.py for the memory design):
    y = x [W_1; ...; W_m; A]^T            ONE product: (B, T, sum_out + R)
    outs = split(y[..., :sum_out] + expand(y[..., sum_out:]))

The LoRA bank's A rows live in the fused buffer after the base rows, so the adapters' shrink costs
no product of its own (R extra rows on thousands), and the expand (one small reduction, see
`adapters._expand`) fuses into the kernel that consumes the projection. Single projections (o,
down) fuse only when an adapter targets them, which is what folds their shrink in; lm_head never
fuses (it is often tied to the embeddings).

Every dense product goes through `kestrel.kernels.decode.gemv.linear`: `F.linear`, except that a
one-row input on CUDA (a batch-1 decode step) runs a Triton matrix-vector kernel, faster than
cuBLAS there (no split-K, no second reduction kernel; bench/RESULTS.md, Decode "Session 2, later").

Adapters stay switchable per row: uniform calls read rows [sum_out, sum_out + hi) and the chosen
adapter's span; mixed calls read every adapter's rows and gate them per row. With no adapter the
product reads the base rows only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from kestrel.decode.adapters import LoraCall, LoraGroup, is_lora_layer
from kestrel.decode.fused import FusedWeight, fusable
from kestrel.kernels.decode import nf4_gemv
from kestrel.kernels.dispatch import use_triton
from kestrel.kernels.decode.gemv import linear

log = logging.getLogger("kestrel")


@dataclass
class Proj:
    """One linear projection's base: a dense weight, or a module for quantized bases."""

    weight: torch.Tensor | None  # (out, in) for a dense base; None when `module` runs the base
    bias: torch.Tensor | None
    module: nn.Module | None  # e.g. bitsandbytes Linear4bit (NF4), called as is
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias) if self.module is None else self.module(x)


def base_module(module: nn.Module) -> nn.Module:
    """The module holding the base weight: PEFT's `base_layer`, else the module itself."""
    return module.base_layer if is_lora_layer(module) else module


def make_proj(module: nn.Module) -> Proj:
    base = base_module(module)
    out = base.out_features
    if isinstance(base, nn.Linear) and base.weight.is_floating_point():
        return Proj(weight=base.weight, bias=base.bias, module=None, out_features=out)
    return Proj(weight=None, bias=None, module=base, out_features=out)


@dataclass
class ProjGroup:
    """Projections that read the same input (q/k/v, gate/up, o, down, lm_head) and their LoRA."""

    projs: list[Proj]
    modules: list[nn.Module]  # the HF modules (PEFT layers when LoRA is attached)
    lora: LoraGroup | None = None
    fused: FusedWeight | None = None
    nf4: nf4_gemv.NF4Weight | None = None  # the NF4 bases as one small-batch kernel reads them
    nf4_source: list[tuple] = field(default_factory=list, repr=False)  # (param, data_ptr, quant_state) each

    @property
    def sizes(self) -> list[int]:
        return [p.out_features for p in self.projs]

    @property
    def quantized(self) -> bool:
        return any(p.module is not None for p in self.projs)

    def __call__(self, x: torch.Tensor, call: LoraCall | None) -> list[torch.Tensor]:
        """x (B, T, in) -> one (B, T, out_i) per member, adapters applied per `call`."""
        if self.fused is not None:
            return self._fused_call(x, call)
        if self.nf4 is not None and nf4_gemv.applies(x, self.nf4):
            y = nf4_gemv.nf4_gemv(x, self.nf4)  # (B, T, sum_out), one launch
            outs = list(y.split(self.sizes, dim=-1)) if len(self.projs) > 1 else [y]
        else:
            outs = [p(x) for p in self.projs]
        delta = self.lora.delta(x, call) if call is not None and self.lora is not None else None
        if delta is not None:
            parts = delta.split(self.sizes, dim=-1)
            outs = [o + d for o, d in zip(outs, parts)]
        return outs

    def _fused_call(self, x: torch.Tensor, call: LoraCall | None) -> list[torch.Tensor]:
        f = self.fused
        span = self.lora.span(call) if call is not None and self.lora is not None else None
        if span is None:
            y = linear(x, f.base, f.base_bias)  # (B, T, sum_out)
        else:
            lo, hi = span
            end = f.n + hi
            y = linear(x, f.weight[:end], None if f.bias is None else f.bias[:end])  # (B, T, sum_out + hi)
            y = y[..., : f.n] + self.lora.expand(y[..., f.n + lo :], call, lo, hi)
        return list(y.split(self.sizes, dim=-1)) if len(self.projs) > 1 else [y]

    # --- fusing -------------------------------------------------------------------------------

    def fuse(self, dtype: torch.dtype, tied: set[int]) -> bool:
        """Put the members' weights (and the LoRA bank's A) into one buffer; True when done."""
        if self.fused is not None:
            return True
        if len(self.projs) == 1 and self.lora is None:
            return False  # nothing to gain: one product either way
        members = [base_module(m) for m in self.modules]
        reason = fusable(members, tied)
        if not reason and self.lora is not None and members[0].weight.dtype != dtype:
            reason = f"base dtype {members[0].weight.dtype} differs from the adapters' {dtype}"
        if reason:
            log.debug("decode: projections kept separate (%s)", reason)
            return False
        extra = 0 if self.lora is None else self.lora.a.shape[0]
        try:
            self.fused = FusedWeight(members, extra)
        except torch.OutOfMemoryError:
            log.warning("decode: no memory to fuse %d projections; they stay separate", len(members))
            return False
        if self.lora is not None:
            self.fused.extra.copy_(self.lora.a)
            self.lora.a = self.fused.extra  # sync() now writes into the buffer
        return True

    # --- NF4 bases -------------------------------------------------------------------------------

    def attach_nf4(self, dtype: torch.dtype) -> bool:
        """Read the members' NF4 weights with `kestrel.kernels.decode.nf4_gemv` at 2-16 rows (values in `dtype`,
        the model's); True when done. Left off (modules called) unless every member is an NF4
        Linear4bit the kernel reads whose module would compute in `dtype` too."""
        self.nf4, self.nf4_source = None, []
        bases = [base_module(m) for m in self.modules]
        reason = _nf4_unreadable(bases, dtype)
        if not reason:
            try:
                self.nf4 = nf4_gemv.nf4_weight([(b.weight, b.weight.quant_state, b.bias) for b in bases], dtype)
            except ValueError as exc:
                reason = str(exc)
        if reason:
            if self.quantized:
                log.debug("decode: NF4 projections called as modules (%s)", reason)
            return False
        self.nf4_source = [(b.weight, b.weight.data_ptr(), b.weight.quant_state) for b in bases]
        return True

    def _nf4_current(self) -> bool:
        """True while every member still holds the weight `self.nf4` reads."""
        bases = [base_module(m) for m in self.modules]
        return all(b.weight is w and b.weight.data_ptr() == ptr and b.weight.quant_state is state
                   for b, (w, ptr, state) in zip(bases, self.nf4_source, strict=True))

    def repair(self) -> bool:
        """Re-bind after a member's storage was replaced; False when the group had to unfuse, or
        its NF4 weights were re-read (captured graphs read the old ones either way)."""
        if self.nf4 is not None and not self._nf4_current():
            self.attach_nf4(self.nf4.dtype)
            return False
        if self.fused is None or self.fused.repair():
            return True
        self.unfuse()
        return False

    def unfuse(self) -> None:
        """Back to separate products; the members get their own storage again."""
        if self.fused is None:
            return
        if self.lora is not None:
            self.lora.a = self.lora.a.clone()
        self.fused.unfuse()
        self.fused = None
        self.projs = [make_proj(m) for m in self.modules]  # the modules' current parameters


def _nf4_unreadable(bases: list[nn.Module], dtype: torch.dtype) -> str:
    """Why `kestrel.kernels.decode.nf4_gemv` cannot stand in for these modules' forward ("" when it can)."""
    if len(bases) > nf4_gemv.MAX_MEMBERS:
        return f"{len(bases)} members"
    for b in bases:
        w = getattr(b, "weight", None)
        state = getattr(w, "quant_state", None)
        if state is None or nf4_gemv.unsupported(w, state):
            return f"{type(b).__name__} is not an NF4 weight the kernel reads"
        if getattr(b, "compute_dtype", None) not in (None, dtype) or state.dtype not in (dtype, torch.float32):
            return f"computes in {b.compute_dtype} from {state.dtype}, not {dtype}"
        if b.bias is not None and b.bias.dtype != dtype:
            return "a bias of another dtype"
        if not use_triton(w):
            return "Triton kernels not chosen for this device"
    return ""


def make_group(*modules: nn.Module) -> ProjGroup:
    return ProjGroup([make_proj(m) for m in modules], list(modules))
