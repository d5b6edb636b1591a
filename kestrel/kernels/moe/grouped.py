"""The grouped matrix product of a mixture-of-experts layer: rows sorted by expert, one product.

    y = grouped_mm(x, w, offsets)      x (M, K) rows sorted by expert, w (E, K, N), offsets (E,)
    y[rows of e] = x[rows of e] @ w[e]  rows of e = offsets[e-1] .. offsets[e] (offsets[-1] == M)

Two launchers, chosen per call by `grouped_impl`:
- "grouped_mm": torch's grouped GEMM (`F.grouped_mm`, else `torch._grouped_mm`), one kernel for all
  experts. It needs 16-byte aligned strides (K and N a multiple of 8 in bf16, 4 in fp32) and, on
  CUDA, bf16 on an sm80+ card; it also has a CPU kernel in torch >= 2.9.
- "padded": experts' rows scattered into an (E, C, K) block, C the largest group, then one `bmm`.
  Loop-free, any dtype or shape; it costs one host sync (C) and E*C rows of work, so it is the
  fallback (odd shapes, fp16, older cards), not the fast path.

`GroupedMM` carries the backward by hand, with the same launchers:
    dx = grouped_mm(dy, w^T, offsets)                      dx[rows of e] = dy[rows of e] w[e]^T
    dw[e] = x[rows of e]^T dy[rows of e]                    (E, K, N); zero for an expert with no rows
dw is only formed when `w` requires grad (LoRA factors do; frozen base experts do not).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

Impl = Literal["auto", "grouped_mm", "padded"]

_TORCH_GMM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _aligned(t: torch.Tensor) -> bool:
    """Every stride but the unit one a multiple of 16 bytes, and the storage 16-byte aligned."""
    size = t.element_size()
    strides_ok = all(s == 1 or (s * size) % 16 == 0 for s in t.stride())
    return strides_ok and t.data_ptr() % 16 == 0 and 1 in t.stride()[-2:]


def grouped_impl(x: torch.Tensor, w: torch.Tensor, impl: Impl = "auto") -> Literal["grouped_mm", "padded"]:
    """Which launcher runs `grouped_mm(x, w, ...)`: torch's grouped GEMM where it takes these
    tensors, else the padded `bmm`. `impl` forces one (tests; "grouped_mm" raises where it cannot run)."""
    if impl != "auto":
        return impl
    if _TORCH_GMM is None or x.dtype != w.dtype:
        return "padded"
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return "padded"
    elif x.dtype not in (torch.bfloat16, torch.float32):
        return "padded"
    return "grouped_mm" if _aligned(x) and _aligned(w) else "padded"


# --- launchers -------------------------------------------------------------------------------


def _group_slots(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(expert of each row (M,), its slot inside its expert's group (M,), largest group C)."""
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())  # (E,)
    experts = torch.repeat_interleave(torch.arange(offsets.numel(), device=offsets.device), counts, output_size=rows)
    slots = torch.arange(rows, device=offsets.device) - (offsets.long() - counts)[experts]
    return experts, slots, int(counts.max()) if rows else 0  # the one host sync


def _padded_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    experts, slots, cap = _group_slots(offsets, x.shape[0])
    block = x.new_zeros(w.shape[0], cap, x.shape[1])  # (E, C, K)
    block[experts, slots] = x
    return torch.bmm(block, w)[experts, slots]  # (M, N)


def _padded_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    experts, slots, cap = _group_slots(offsets, x.shape[0])
    xb = x.new_zeros(offsets.numel(), cap, x.shape[1])  # (E, C, K)
    db = dy.new_zeros(offsets.numel(), cap, dy.shape[1])  # (E, C, N)
    xb[experts, slots], db[experts, slots] = x, dy
    return torch.bmm(xb.transpose(1, 2), db)  # (E, K, N)


def grouped_forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """x (M, K) sorted by expert, w (E, K, N) (any strides), offsets (E,) int32 -> (M, N)."""
    if grouped_impl(x, w, impl) == "grouped_mm":
        return _TORCH_GMM(x, w, offs=offsets)
    return _padded_mm(x, w, offsets)


def grouped_weight_grad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """dw (E, K, N) with dw[e] = x[rows of e]^T dy[rows of e]; x (M, K), dy (M, N)."""
    if grouped_impl(x, dy, impl) == "grouped_mm":
        # torch's grouped GEMM groups along the reduced dimension when both operands are 2-D.
        return _TORCH_GMM(x.t(), dy, offs=offsets)
    return _padded_wgrad(x, dy, offsets)


# --- autograd --------------------------------------------------------------------------------


class GroupedMM(torch.autograd.Function):
    """y = grouped_mm(x, w, offsets) with the backward of the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, impl: Impl) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets)
        ctx.impl = impl
        return grouped_forward(x, w, offsets, impl)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()  # a broadcast gradient (from .sum()) has zero strides
        dx = grouped_forward(dy, w.transpose(1, 2), offsets, ctx.impl) if ctx.needs_input_grad[0] else None
        dw = grouped_weight_grad(x, dy, offsets, ctx.impl) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """x (M, K) rows sorted by expert, w (E, K, N), offsets (E,) int32 cumulative row counts -> (M, N)."""
    if x.dtype != w.dtype:
        x = x.to(w.dtype)  # an fp32 activation meeting 16-bit experts, as HF casts
    return GroupedMM.apply(x, w, offsets, impl)
