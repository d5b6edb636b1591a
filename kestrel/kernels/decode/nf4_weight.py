"""The NF4 weight as `nf4_gemv.py`'s kernel reads it: up to three bitsandbytes NF4 matrices of one K
stacked along the output dimension (q/k/v, gate/up), their absmax decoded to fp32 once, the
code table and its byte pairs, the split-K tickets, and the measured plan of their shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kestrel.kernels import nf4
from kestrel.kernels._utils import cdiv, sm_count
from kestrel.kernels.decode.nf4_tiles import Plan, Tiles, choose_tiles, device_name, measured_plan

__all__ = ["MAX_MEMBERS", "MIN_ROWS", "NF4Weight", "code_pairs", "decoded_absmax", "dequantized", "nf4_weight",
           "unsupported"]

MIN_ROWS = 2  # rows from which the decode path takes this kernel unless a measured plan says one row too
MAX_MEMBERS = 3


@dataclass(frozen=True)
class NF4Weight:
    """Up to three NF4 matrices of the same K stacked along the output dimension, as the kernel
    reads them (member i owns output rows [ends[i - 1], ends[i])). Built by `nf4_weight`.

    packed: per member, uint8 (out_i * K / 2,): the Params4bit's own storage (an alias, no copy)
    absmax: per member, fp32 (out_i * K / blocksize,): decoded once (`nf4_gemv` module docstring: why)
    bias: per member, (out_i,) in the compute dtype (zeros for a member without one), or None
    code: fp32 (16,) the NF4 levels
    pairs: int64 (256,) per byte value b, code[b >> 4]'s fp32 bits | code[b & 15]'s << 32
    tickets: int32 (N,) zeros: split-K counters (one per row tile), left zero by every launch
    plan: the tiles measured for this (device, N, K) (`nf4_tiles.measured_plan`), or None
    min_rows: the fewest rows the decode path runs here (1 where the plan measured this kernel
    faster than bitsandbytes' one-row GEMV, else MIN_ROWS)
    register_table: the PRMT lookup can read it (bitsandbytes' NF4 code, packed buffers 4-byte
    aligned); elsewhere tiles asking for PRMT run the NIBBLE lookup (the same values)
    """

    packed: tuple[torch.Tensor, ...]
    absmax: tuple[torch.Tensor, ...]
    bias: tuple[torch.Tensor, ...] | None
    code: torch.Tensor
    pairs: torch.Tensor
    tickets: torch.Tensor
    sizes: tuple[int, ...]
    k: int
    blocksize: int
    dtype: torch.dtype  # the compute dtype the values are rounded to (x's)
    sms: int
    plan: Plan | None = None
    min_rows: int = MIN_ROWS
    register_table: bool = False

    @property
    def n(self) -> int:
        return sum(self.sizes)

    def tiles_for(self, m: int) -> Tiles:
        """The tiles for m rows: measured (`plan`) where the sweep ran, else the cost model's."""
        t = self.plan.for_rows(m) if self.plan is not None else None
        return t or choose_tiles(m, self.n, self.k, self.blocksize, self.sms)

    @property
    def nbytes(self) -> int:
        """Bytes a product reads from the weight: packed nibbles, fp32 absmax, bias."""
        tensors = [*self.packed, *self.absmax, *(self.bias or ())]
        return sum(t.numel() * t.element_size() for t in tensors)


def unsupported(packed: torch.Tensor, quant_state: Any, k: int | None = None) -> str:
    """Why an NF4 weight cannot be read by this kernel ("" when it can)."""
    if getattr(quant_state, "quant_type", None) != "nf4" or packed.dtype != torch.uint8:
        return "not an NF4 weight"
    if getattr(quant_state, "packing_format_for_cpu", False):
        return "repacked for bitsandbytes' CPU kernel"
    shape = tuple(int(d) for d in quant_state.shape)
    bs = int(quant_state.blocksize)
    if len(shape) != 2 or packed.numel() * 2 != shape[0] * shape[1]:
        return f"packed bytes do not match shape {shape}"
    if bs < 16 or bs & (bs - 1) or shape[1] % bs:
        return f"in_features {shape[1]} is not a multiple of the power-of-two blocksize {bs}"
    if k is not None and shape[1] != k:
        return "members differ in in_features"
    if not packed.is_contiguous():
        return "packed weight is not contiguous"
    return ""


def nf4_weight(members: Sequence[tuple[torch.Tensor, Any, torch.Tensor | None]],
               dtype: torch.dtype) -> NF4Weight:
    """members: (packed uint8, quant_state, bias or None) each, same K and blocksize, at most
    three -> the `NF4Weight` of them stacked, values rounded to `dtype` (fp16 or bf16).
    Raises ValueError when they cannot be read together (`unsupported`)."""
    if not 1 <= len(members) <= MAX_MEMBERS or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{len(members)} members in {dtype}: need 1-{MAX_MEMBERS} in fp16 or bf16")
    k = int(members[0][1].shape[1])
    bs = int(members[0][1].blocksize)
    device = members[0][0].device
    code = nf4._code(members[0][1], device)
    for packed, state, _ in members:
        reason = unsupported(packed, state, k)
        if not reason and int(state.blocksize) != bs:
            reason = "members differ in blocksize"
        if not reason and not torch.equal(nf4._code(state, device), code):
            reason = "members differ in their NF4 code"
        if reason:
            raise ValueError(reason)
    sizes = tuple(int(state.shape[0]) for _, state, _ in members)
    plan = measured_plan(device_name(device), sum(sizes), k)
    register_table = (torch.equal(code.cpu(), torch.tensor(nf4.NF4_CODE))
                      and all(p.data_ptr() % 4 == 0 for p, _, _ in members))
    has_bias = any(b is not None for _, _, b in members)
    bias = tuple(torch.zeros(n, dtype=dtype, device=device) if b is None else b.detach()
                 for n, (_, _, b) in zip(sizes, members)) if has_bias else None
    return NF4Weight(
        packed=tuple(torch.Tensor.as_subclass(p, torch.Tensor).reshape(-1) for p, _, _ in members),
        absmax=tuple(decoded_absmax(s, device) for _, s, _ in members), bias=bias, code=code,
        pairs=code_pairs(code), tickets=torch.zeros(sum(sizes), dtype=torch.int32, device=device),
        sizes=sizes, k=k, blocksize=bs, dtype=dtype, sms=sm_count(device), plan=plan,
        min_rows=1 if plan is not None and plan.kernel_one_row else MIN_ROWS, register_table=register_table,
    )


def code_pairs(code: torch.Tensor) -> torch.Tensor:
    """int64 (256,): entry b holds code[b >> 4]'s fp32 bits in its low 32 bits and code[b & 15]'s in
    its high 32 (byte b's elements 2j and 2j + 1, in memory order)."""
    b = torch.arange(256, device=code.device)
    bits = code.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # (16,) unsigned
    return bits[b >> 4] | (bits[b & 15] << 32)


def decoded_absmax(quant_state: Any, device: torch.device) -> torch.Tensor:
    """fp32 (n_blocks,) absmax of a weight, decoded from double quantization exactly as
    bitsandbytes does (`nf4._absmax_reference`: mul and add rounded separately); a plain fp32
    absmax is returned as is (no copy)."""
    n = 1
    for d in quant_state.shape:
        n *= int(d)
    n_blocks = cdiv(n, int(quant_state.blocksize))
    return nf4._absmax_reference(quant_state, n_blocks, device).contiguous()


def dequantized(weight: NF4Weight) -> torch.Tensor:
    """(N, K) in `weight.dtype`: the stacked members dequantized (PyTorch; tests, the reference)."""
    parts = []
    for packed, absmax, n in zip(weight.packed, weight.absmax, weight.sizes):
        nibbles = torch.stack((packed >> 4, packed & 15), dim=-1).reshape(n, weight.k).long()
        scale = absmax.view(n, weight.k // weight.blocksize).repeat_interleave(weight.blocksize, dim=1)
        parts.append((weight.code[nibbles] * scale).to(weight.dtype))
    return torch.cat(parts)
