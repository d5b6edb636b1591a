"""QLoRA on mixture-of-experts models: the experts' 3-D weights stored in NF4.

bitsandbytes' 4-bit loading quantizes `nn.Linear` only, so Hugging Face loads a MoE's experts
(`gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I) in Qwen3-MoE; (E, in, out) in gpt-oss) in
16-bit. `quantize_experts` then replaces each of them, one parameter at a time, by NF4
(`kestrel.kernels.moe.PackedExperts`, held in `experts.kestrel_nf4[name]`), which the patched MoE
block's grouped product dequantizes per layer on the fly (`kestrel.kernels.moe.nf4_experts`).

Memory: storage about 0.52 byte a parameter (NF4 codes, double-quantized absmax) against 2 in
bf16. Quantizing frees each projection's 16-bit copy before the next is quantized, so the memory
only falls from there; but Hugging Face has loaded every layer's 16-bit experts onto the device
before this step, so loading still needs the 16-bit experts' memory once (Qwen3-30B-A3B: about
58 GB), and training then holds them in NF4 (about 15 GB). In training one projection of one
layer's experts exists in 16-bit at a time (the shared NF4 workspace).

The parameter itself stays, so PEFT's `target_parameters` LoRA wraps it as before (it reads its
shape, dtype and device): a frozen placeholder of the right shape over a single element (a
zero-stride view, 2 bytes). Its values are not the weights: only the patched block computes
with the experts, and the experts module's own forward (HF's, which PEFT's wrapper calls too)
is rebound to one that refuses with a clear error. `ExpertQuantHandle.undo()`
puts dequantized 16-bit parameters back (NF4-rounded, not the original values). The packed
tensors stay on the device they were quantized on (a QLoRA model is loaded onto its GPU and not
moved): a later `model.to()` moves the placeholders only, and the grouped product then fails on
the device mismatch rather than computing anything.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kestrel.errors import ModelLoadError
from kestrel.kernels.moe import PackedExperts
from kestrel.model.registry import FamilySpec

PACKED_ATTR = "kestrel_nf4"  # on an experts module: {parameter name: PackedExperts}
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def packed_experts(experts: nn.Module) -> dict[str, PackedExperts]:
    """The NF4 projections of an experts module (PEFT-unwrapped), empty when it is 16-bit."""
    return getattr(experts, PACKED_ATTR, None) or {}


def _placeholder(like: torch.Tensor) -> nn.Parameter:
    """A frozen parameter with `like`'s shape, dtype and device over one element."""
    return nn.Parameter(like.new_zeros(1).expand(like.shape), requires_grad=False)


def _refuse(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    raise ModelLoadError(
        "this model's experts are stored in NF4 (QLoRA), which only Kestrel's grouped expert product reads: keep "
        "the model patched (patch=True) and one LoRA adapter active, without a LoRA bias on the experts"
    )


@dataclass
class ExpertQuantHandle:
    """The experts modules quantized by `quantize_experts`; `undo()` makes them 16-bit parameters again."""

    model: nn.Module
    modules: list[nn.Module] = field(default_factory=list)
    _forwards: list[Any] = field(default_factory=list)  # each module's own forward before, or None

    @property
    def nbytes(self) -> int:
        """Bytes the NF4 experts hold."""
        return sum(p.nbytes for m in self.modules for p in packed_experts(m).values())

    def undo(self) -> None:
        for experts, previous in zip(self.modules, self._forwards):
            for name, packed in packed_experts(experts).items():
                setattr(experts, name, nn.Parameter(packed.stored().clone(), requires_grad=False))
            delattr(experts, PACKED_ATTR)
            if previous is None:
                del experts.forward
            else:
                experts.forward = previous
        self.modules.clear()
        self._forwards.clear()
        if getattr(self.model, "kestrel_expert_quant", None) is self:
            del self.model.kestrel_expert_quant


def quantize_experts(model: nn.Module, spec: FamilySpec) -> ExpertQuantHandle:
    """Store the experts of every MoE block of `model` in NF4, in place (before LoRA is attached).

    Each parameter is quantized on its own device (the GPU under QLoRA), then dropped. The handle
    is also kept as `model.kestrel_expert_quant`."""
    if spec.moe is None:
        raise ValueError(f"{spec.model_type} has no mixture-of-experts blocks to quantize")
    if getattr(model, "kestrel_expert_quant", None) is not None:
        return model.kestrel_expert_quant
    if hasattr(model, "peft_config"):
        raise ValueError("quantize the experts before attaching LoRA: PEFT wraps the parameters it targets")
    handle = ExpertQuantHandle(model)
    for block in (m for m in model.modules() if type(m).__name__ == spec.moe.block_class):
        experts = block.experts
        packed: dict[str, PackedExperts] = {}
        for name in EXPERT_WEIGHTS:
            param = getattr(experts, name)
            packed[name] = PackedExperts(param.data, transposed=spec.moe.transposed)
            setattr(experts, name, _placeholder(param))
            del param  # the 16-bit copy goes now, before the next projection is quantized
        setattr(experts, PACKED_ATTR, packed)
        handle.modules.append(experts)
        handle._forwards.append(experts.__dict__.get("forward"))
        experts.forward = types.MethodType(_refuse, experts)
    model.kestrel_expert_quant = handle
    return handle
