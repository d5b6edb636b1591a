"""Variable-length attention with attention sinks (gpt-oss), on the flash kernel.

A sink is one extra key per query head h with logit s_h and value 0: it takes a share of each
softmax's mass and gives nothing back. For one query row with scores S_j = scale * q.k_j over the
keys it may see (its sample, its window):

    lse  = logsumexp_j S_j                     flash's softmax_lse
    O    = sum_j exp(S_j - lse) V_j            flash's output
    O_s  = O * sigmoid(lse - s_h)              the sink softmax's output
    lse' = logaddexp(lse, s_h)                 the sink softmax's normaliser

since the sink softmax's weights are P'_j = exp(S_j - lse') = P_j * sigmoid(lse - s_h).

Backward, with g = dL/dO_s. Flash's backward computes, from (grad_out, out, logsumexp),
P_j = exp(S_j - logsumexp), D = rowsum(grad_out * out) and dS_j = P_j (dP_j - D), dP_j = g.V_j.
Called with out = O_s and logsumexp = lse', that is exactly the sink softmax's backward
(P'_j, D = rowsum(g * O_s), and the sink's own term drops out because its value is 0), so it
returns the exact dq, dk, dv. The sink logit's gradient, with P_sink = exp(s_h - lse') =
1 - sigmoid(lse - s_h) the sink's weight:

    dL/ds_h = -sum over the head's query rows of P_sink * D

The flash forward and backward are a parameter (`FlashKernels`), never a global: `ATEN_FLASH`
calls torch's aten flash ops on CUDA; tests hand in a pure-torch stand-in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

Window = tuple[int, int]  # flash's (left, right), `kestrel.model.attention.flash_window`
# (q (N, Hq, D), k, v (N, Hkv, D), cu (S+1,) int32, max_len, scale, window) -> out (N, Hq, D), lse (Hq, N) fp32
FlashForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float, Window],
                        tuple[torch.Tensor, torch.Tensor]]
# (grad_out, q, k, v, out, lse (Hq, N), cu, max_len, scale, window) -> dq, dk, dv (shaped as q, k, v)
FlashBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class FlashKernels:
    """A varlen attention forward that returns its logsumexp, and the backward that takes one."""

    forward: FlashForward
    backward: FlashBackward


def aten_flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float, window: Window,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's flash forward over the samples `cu` bounds (self-attention), called as
    `torch.nn.attention.varlen` calls it (torch 2.11 and 2.13 share these arguments). Flash takes
    Hkv < Hq natively. Returns out (N, Hq, D) and softmax_lse (Hq, N) fp32."""
    left, right = window
    out, lse, _rng, _unused, _debug = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len,
        0.0,  # dropout_p
        window == (-1, 0),  # is_causal, as varlen_attn sets it
        False,  # return_debug_mask
        scale=scale, window_size_left=left, window_size_right=right,
    )
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):  # ROCm's flash lays it out (samples, heads, max_len)
        raise RuntimeError(f"flash returned a logsumexp of shape {tuple(lse.shape)}, not (heads, tokens) = "
                           f"{(q.shape[1], q.shape[0])}; attention sinks need CUDA's flash layout")
    return out, lse


def aten_flash_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float, window: Window,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's flash backward for `aten_flash_forward`; dk, dv have Hkv heads (summed over each group)."""
    left, right = window
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: never read
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out, q, k, v, out, lse, cu, cu, max_len, max_len,
        0.0, window == (-1, 0), rng_state, unused,
        scale=scale, window_size_left=left, window_size_right=right,
    )
    return dq, dk, dv


ATEN_FLASH = FlashKernels(aten_flash_forward, aten_flash_backward)


class SinkAttention(torch.autograd.Function):
    """O_s = sink softmax attention over varlen samples; the module docstring gives the math."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, cu: torch.Tensor,
        max_len: int, scale: float, window: Window, kernels: FlashKernels,
    ) -> torch.Tensor:
        out, lse = kernels.forward(q, k, v, cu, max_len, scale, window)  # (N, Hq, D), (Hq, N)
        s = sinks.to(lse.dtype)[:, None]  # (Hq, 1), in lse's precision (flash's: fp32)
        kept = torch.sigmoid(lse - s).t().unsqueeze(-1)  # (N, Hq, 1) fp32: the real keys' share of the mass
        out_s = (out.to(kept.dtype) * kept).to(out.dtype)  # (N, Hq, D), rounded once: the backward's D reads it
        lse_s = torch.logaddexp(lse, s)  # (Hq, N)
        ctx.save_for_backward(q, k, v, sinks, cu, out_s, lse_s)
        ctx.args = (max_len, scale, window, kernels)
        return out_s

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, sinks, cu, out_s, lse_s = ctx.saved_tensors
        max_len, scale, window, kernels = ctx.args
        grad = grad.contiguous()
        dq = dk = dv = d_sinks = None
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = kernels.backward(grad, q, k, v, out_s, lse_s, cu, max_len, scale, window)
        if ctx.needs_input_grad[3]:
            acc = lse_s.dtype
            d = (grad.to(acc) * out_s.to(acc)).sum(-1)  # (N, Hq): D = rowsum(g * O_s)
            p_sink = torch.exp(sinks.to(acc)[:, None] - lse_s)  # (Hq, N)
            d_sinks = -(p_sink * d.t()).sum(-1).to(sinks.dtype)  # (Hq,)
        return dq, dk, dv, d_sinks, None, None, None, None, None


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, cu: torch.Tensor, max_len: int,
    scale: float, window: Window, kernels: FlashKernels,
) -> torch.Tensor:
    """q (N, Hq, D), k and v (N, Hkv, D), sinks (Hq,), cu (S+1,) int32 sample bounds -> (N, Hq, D)."""
    return SinkAttention.apply(q, k, v, sinks, cu, max_len, scale, window, kernels)


def flash_sink_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: Window = (-1, -1),
    enable_gqa: bool = True,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """`varlen_attn`'s signature (a `kestrel.model.attention.VarlenFn`) plus the sinks (Hq,), on
    CUDA's flash kernel. Self-attention only: the same samples for queries and keys. `enable_gqa`
    is there so `varlen_attention` hands over Hkv < Hq heads unrepeated: flash reads them natively."""
    if cu_seq_q is not cu_seq_k or max_q != max_k:
        raise ValueError("sink attention handles self-attention only (the same cu_seqlens for queries and keys)")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return sink_attention(query, key, value, sinks, cu_seq_q, max_q, scale, tuple(window_size), ATEN_FLASH)
