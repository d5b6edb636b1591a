"""Frozen expert weights stored in NF4 and dequantized per layer inside the grouped product (QLoRA
on a mixture of experts).

    y = nf4_grouped_mm(x, packed, offsets)     x (M, K) rows sorted by expert, packed: (E, K, N) in NF4
      = grouped_mm(x, dequantize(packed), offsets)

Storage (`PackedExperts`): bitsandbytes' NF4 layout, as the 4-bit linears use (blocksize 64, double
quantization): 0.5 byte a parameter plus one uint8 absmax a 64-block and one fp32 second-level scale
a 256 blocks, about 0.52 byte a parameter against 2 in bf16.

Memory: the (E, K, N) weights exist in the compute dtype only while one product runs. Forward
dequantizes them into the shared NF4 workspace (`kestrel.kernels.nf4.dequantize`: one buffer per
device and dtype, grown to the largest weight dequantized, so one projection of one layer's experts
in 16-bit, E*K*N*2 bytes) and keeps nothing of it for backward. The weights are frozen, so backward
needs only the input gradient, and dequantizes again:
    dx = grouped_mm(dy, dequantize(packed)^T, offsets)          dx[rows of e] = dy[rows of e] w[e]^T
LoRA factors on these experts run as their own grouped products beside this one
(`kestrel.kernels.moe.experts.ExpertProjection`), so their gradients never touch the base weight.
"""

from __future__ import annotations

from typing import Any

import torch

from kestrel.kernels import nf4
from kestrel.kernels.moe.grouped import Impl, grouped_forward

BLOCKSIZE = 64  # as the 4-bit linears (bitsandbytes' default)


class PackedExperts:
    """One projection of every expert in NF4: the (E, a, b) parameter as stored by the family.

    `transposed` says how the grouped product reads the stored tensor: False when it is stored
    (E, out, in) (Qwen3-MoE's experts: read through a transposed view), True when (E, in, out) (gpt-oss).
    """

    def __init__(self, weight: torch.Tensor, transposed: bool, nested: bool = True) -> None:
        """Quantize `weight` (E, a, b), any float dtype; the result dequantizes back to that dtype.
        `nested`: double-quantize the absmax (bitsandbytes' compress_statistics; the 4-bit linears' default)."""
        from bitsandbytes.functional import quantize_4bit

        if weight.dim() != 3:
            raise ValueError(f"expert weights are (experts, rows, columns), got shape {tuple(weight.shape)}")
        self.packed, self.state = quantize_4bit(
            weight.detach().contiguous(), blocksize=BLOCKSIZE, quant_type="nf4", compress_statistics=nested,
        )
        self.stored_shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.transposed = transposed

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, in, out), as the grouped product reads the weight."""
        e, a, b = self.stored_shape
        return (e, a, b) if self.transposed else (e, b, a)

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes, absmax and the second-level scales."""
        state = self.state
        held = [self.packed, state.absmax, state.offset, state.code]
        if state.state2 is not None:
            held += [state.state2.absmax, state.state2.code]
        return sum(t.numel() * t.element_size() for t in held)

    def stored(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The stored-layout weight (E, a, b) in `self.dtype`: a view of the shared NF4 workspace
        (valid until the next dequantization on this device and dtype), or written into `out`."""
        return nf4.dequantize(self.packed, self.state, out=out, dtype=self.dtype)

    def select(self, index: torch.Tensor) -> torch.Tensor:
        """index (M,) expert ids -> (M, a, b) those experts' stored-layout weights in `self.dtype`.

        Only the chosen experts' codes and block scales are read (a decode step's top-k). Needs
        each expert's a*b values to be whole 64-blocks (`selectable`), so that expert e owns bytes
        [e*a*b/2, (e+1)*a*b/2) of the codes and blocks [e*a*b/64, (e+1)*a*b/64). The values are
        bitsandbytes' (`kestrel.kernels.nf4.dequantize_reference`): code[nibble] * absmax in fp32,
        rounded once. Loop-free, no host read (captured in CUDA graphs)."""
        e, a, b = self.stored_shape
        per, m = a * b, index.shape[0]
        codes = self.packed.reshape(e, per // 2)[index]  # (M, a*b/2) uint8
        nibbles = torch.stack((codes >> 4, codes & 15), dim=-1).reshape(m, per // BLOCKSIZE, BLOCKSIZE).long()
        n_blocks = per // BLOCKSIZE
        blocks = index[:, None] * n_blocks + torch.arange(n_blocks, device=index.device)  # (M, a*b/64)
        state = self.state
        if state.nested:  # absmax[blk] = code2[q[blk]] * absmax2[blk // 256] + offset, rounded apart
            state2 = state.state2
            scale = state2.code.float()[state.absmax[blocks].long()] * state2.absmax.float()[blocks // state2.blocksize]
            scale = scale + state.offset.float()
        else:
            scale = state.absmax.float()[blocks]
        values = state.code.float()[nibbles] * scale[..., None]  # (M, a*b/64, 64)
        return values.to(self.dtype).view(m, a, b)

    @property
    def selectable(self) -> bool:
        """True when each expert's values are whole quant blocks (`select` reads them apart)."""
        return (self.stored_shape[1] * self.stored_shape[2]) % BLOCKSIZE == 0

    def weight(self) -> torch.Tensor:
        """(E, in, out) in `self.dtype`, a view of the shared workspace (see `stored`)."""
        w = self.stored()
        return w if self.transposed else w.transpose(1, 2)


class NF4GroupedMM(torch.autograd.Function):
    """y = grouped_mm(x, dequantize(packed), offsets), the weight dequantized again in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: PackedExperts, offsets: torch.Tensor, impl: Impl) -> torch.Tensor:
        ctx.save_for_backward(offsets)  # neither x (no weight gradient) nor the dequantized weight
        ctx.packed, ctx.impl = packed, impl
        return grouped_forward(x, packed.weight(), offsets, impl)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (offsets,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        dy = dy.contiguous()  # a broadcast gradient (from .sum()) has zero strides
        return grouped_forward(dy, ctx.packed.weight().transpose(1, 2), offsets, ctx.impl), None, None, None


def nf4_grouped_mm(x: torch.Tensor, packed: PackedExperts, offsets: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """x (M, K) rows sorted by expert, packed (E, K, N) in NF4, offsets (E,) int32 -> (M, N) in `packed.dtype`."""
    if x.dtype != packed.dtype:
        x = x.to(packed.dtype)  # an fp32 activation meeting 16-bit experts, as HF casts
    return NF4GroupedMM.apply(x, packed, offsets, impl)
