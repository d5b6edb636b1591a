"""Causal attention whose backward starts from a kept output: a checkpoint's recompute without the
attention forward.

A checkpointed layer runs its attention forward twice: in its first pass, and again in the recompute
that builds the graph for its backward. At long rows that second forward is a large share of the step
(quadratic in the row's length: at 8,192 tokens about a third of a 1B-4B layer's forward FLOPs). Its
only use in the backward is (out, lse), which the first pass already computed. Keeping them from the
first pass (somewhere off the GPU, as offloaded checkpointing keeps the MLP's gate product) lets the
recompute hand them to `KeptAttention` instead.

Math, for one head with queries Q (S, D), keys K and values V (S, D), causal, scale s:

    S_ij = s q_i.k_j  (j <= i),   lse_i = logsumexp_j S_ij,   P_ij = exp(S_ij - lse_i),   O = P V

Backward, given dO (flash attention's, from (Q, K, V, O, lse) alone):

    D_i  = rowsum(dO_i * O_i)
    dP   = dO V^T,   dS = P * (dP - D)
    dQ   = s dS K,   dK = s dS^T Q,   dV = P^T dO

With Hkv < Hq key/value heads (grouped-query attention), query head h reads KV head h // (Hq / Hkv),
and dK, dV sum over each group.

The forward and backward are a parameter (`CausalKernels`), never a global: `CUDNN_CAUSAL` calls
torch's cuDNN attention ops on CUDA (what SDPA runs there for these shapes, bench/RESULTS.md,
"Attention back ends"); `REFERENCE_CAUSAL` is the math above in PyTorch, for tests and the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from kestrel.kernels.lora.lora import lora_linear_known, lora_projections_known
from kestrel.model.fused_lora import fused_lora_weights, project_together
from kestrel.model.registry import family_for, text_config

KEPT_KWARG = "kestrel_kept_attention"  # the keyword a checkpointed decoder layer hands its attention (`AttentionStore`)

# (q (B, Hq, S, D), k, v (B, Hkv, S, D), scale) -> out (B, Hq, S, D), lse (fp32, B x Hq x S, the kernel's layout)
CausalForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
# (grad_out, q, k, v, out, lse, scale) -> dq, dk, dv (shaped as q, k, v)
CausalBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class CausalKernels:
    """A causal attention forward that returns its logsumexp, and the backward that takes one."""

    forward: CausalForward
    backward: CausalBackward


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv * groups, S, D), query head h reading KV head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold_groups(dx: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, Hq, S, D) -> (B, Hkv, S, D): each KV head's gradient, summed over the query heads reading it."""
    b, hq, s, d = dx.shape
    return dx if hq == hkv else dx.view(b, hkv, hq // hkv, s, d).sum(2)


def reference_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's forward in PyTorch: out (B, Hq, S, D) in q's dtype, lse (B, Hq, S) in fp32
    (fp64 for fp64 inputs)."""
    groups, acc = q.shape[1] // k.shape[1], torch.promote_types(q.dtype, torch.float32)
    k, v = _repeat_kv(k, groups).to(acc), _repeat_kv(v, groups).to(acc)
    s = q.shape[2]
    scores = (q.to(acc) @ k.transpose(-1, -2)) * scale  # (B, Hq, S, S)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, S)
    out = torch.exp(scores - lse[..., None]) @ v
    return out.to(q.dtype), lse


def reference_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's backward in PyTorch (fp32 inside, fp64 for fp64), from (q, k, v, out, lse) alone."""
    hkv, groups, acc = k.shape[1], q.shape[1] // k.shape[1], torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = q.to(acc), _repeat_kv(k, groups).to(acc), _repeat_kv(v, groups).to(acc)
    g, o = grad.to(acc), out.to(acc)
    s = q.shape[2]
    scores = (qf @ kf.transpose(-1, -2)) * scale
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    p = torch.exp(scores - lse.to(acc).reshape(*scores.shape[:-1], 1)).masked_fill(~causal, 0.0)  # (B, Hq, S, S)
    d = (g * o).sum(-1, keepdim=True)  # (B, Hq, S, 1)
    ds = p * (g @ vf.transpose(-1, -2) - d)
    dq = scale * ds @ kf
    dk = _fold_groups(scale * ds.transpose(-1, -2) @ qf, hkv)
    dv = _fold_groups(p.transpose(-1, -2) @ g, hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


REFERENCE_CAUSAL = CausalKernels(reference_forward, reference_backward)


def cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's cuDNN attention forward, causal, no dropout, its logsumexp returned (what SDPA calls for
    `is_causal` on Hopper, K/V heads unrepeated as with `enable_gqa`)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None,  # attn_bias
        True,  # compute_log_sumexp
        0.0, True, False,  # dropout_p, is_causal, return_debug_mask
        scale=scale,
    )
    return out, lse


def cudnn_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's cuDNN attention backward for `cudnn_forward`. Without dropout its random state is never
    read (an empty placeholder here). The bias and the sequence offsets are passed as None, which the
    op receives as undefined tensors: a defined one, even empty, would be read as a bias of that shape
    or as nested rows."""
    out = _in_layout(out, _dense_strides_like(q, out.shape))  # where cuDNN's forward would have put it
    grad = _in_layout(grad, out.stride())  # the kernel reads dO in O's layout
    unused = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse,
        unused, unused,  # philox_seed, philox_offset
        None,  # attn_bias
        None, None, q.shape[2], k.shape[2],  # cum_seq_q, cum_seq_k, max_q, max_k
        0.0, True,  # dropout_p, is_causal
        scale=scale,
    )
    return dq, dk, dv


def _dense_strides_like(ref: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    """Dense strides for `shape` that order its dims as `ref`'s strides do (innermost first), the layout
    cuDNN's attention forward gives its output for a query laid out as `ref`. The backward must get O in
    that layout: torch caches cuDNN's backward graphs by q, k and v's layouts (not O's in every torch
    version), so an O laid out otherwise can meet a graph built for the forward's own layout and be
    misread (wrong gradients, no error)."""
    order = sorted(range(len(shape)), key=lambda d: ref.stride(d) or 1 << 62)  # stable: ties keep dim order
    strides, step = [0] * len(shape), 1
    for d in order:
        strides[d], step = step, step * shape[d]
    return tuple(strides)


def _in_layout(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """`t` itself when it has these strides, else a copy that has them."""
    if t.stride() == tuple(strides):
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


CUDNN_CAUSAL = CausalKernels(cudnn_forward, cudnn_backward)


class KeptAttention(torch.autograd.Function):
    """out = causal attention of (q, k, v), handed in already computed (the first pass's `out`, `lse`);
    backward as the module docstring gives it. q (B, Hq, S, D), k and v (B, Hkv, S, D)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept: tuple[torch.Tensor, torch.Tensor],
        scale: float, kernels: CausalKernels,
    ) -> torch.Tensor:
        out, lse = kept  # not inputs of the Function: their memory is the kept buffers', no aliasing
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.kernels = scale, kernels
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernels.backward(grad, q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None, None, None


def kept_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept: tuple[torch.Tensor, torch.Tensor], scale: float,
    kernels: CausalKernels,
) -> torch.Tensor:
    """Causal attention (B, Hq, S, D) from the first pass's kept (out, lse): no forward is run."""
    return KeptAttention.apply(q, k, v, kept, scale, kernels)


class AttentionStore(Protocol):
    """Keeps a checkpointed layer's attention output and logsumexp from its first pass to its recompute
    (`kestrel.recompute.host_tensors.KeptAttentionOutput` pages them to host memory)."""

    def admits(self, seq: int, rows: int, hidden: int, device: torch.device) -> bool:
        """Whether a first pass of `rows` rows, in rows `seq` long, keeps its output (`keep_attention: auto`:
        `worth_keeping` and the host link's room)."""

    def keep(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Called once in the first pass; the store copies them (in stream order)."""

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out, lse) back on their device for the recompute, or None when nothing was kept."""

    keeps_projection: bool  # whether the output projection's output is kept with them (`keep_projection`)

    def keep_projection(self, y: torch.Tensor) -> None:
        """The first pass's output projection output, kept after (out, lse) were."""

    def take_projection(self) -> torch.Tensor | None:
        """That output back on its device for the recompute, or None."""

    keeps_qkv: bool  # whether the Q, K and V projections' outputs are kept with them (`keep_qkv`)

    def keep_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The first pass's Q, K and V projection outputs (..., out_k), before norms and RoPE turn them."""

    def take_qkv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Those outputs back on their device for the recompute, or None."""


@dataclass(frozen=True)
class Keeping:
    """What a keeping layer pages out at one row count beside its input: its attention output (with the
    logsumexp), and with it its output projection's output (`keep_projection`) and its Q, K and V (`keep_qkv`)."""

    attention: bool = False
    projection: bool = False
    qkv: bool = False

    def describe(self) -> str:
        return "the attention output" + (", the output projection's output" if self.projection else "") + (
            ", Q, K and V" if self.qkv else "")


@dataclass(frozen=True)
class KeptBytes:
    """Bytes a row of each tensor a keeping layer may page out (`Keeping`'s parts)."""

    attention: int = 0  # the output, heads x head_dim in 16 bits, and one fp32 logsumexp a head
    projection: int = 0  # the output projection's output, hidden x 2
    qkv: int = 0  # Q, K and V, (heads + 2 KV heads) x head_dim x 2

    def of(self, keeping: Keeping) -> int:
        return (keeping.attention * self.attention + keeping.projection * self.projection
                + keeping.qkv * self.qkv)

    @classmethod
    def of_model(cls, config: Any) -> KeptBytes:
        """The sizes for a model's `config` (an image-text one's text config is read). Where layers differ
        in head size (Gemma 4's `per_layer_config`), the widest layer's: one layer's pages must fit the
        link's time for a layer."""
        text = text_config(config).to_dict()  # a per-layer config refuses to give its attributes globally
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        base = int(text.get("head_dim") or text["hidden_size"] // heads)
        size = max([base, *(int(layer.get("head_dim") or base) for layer in (text.get("per_layer_config") or {}).values())])
        spec = family_for(config)
        queries = 2 * heads if spec is not None and spec.attn_output_gate else heads  # q_proj's gate half rides along
        return cls(heads * (size * 2 + 4), 2 * int(text["hidden_size"]), (queries + 2 * kv_heads) * size * 2)


def worth_keeping(seq: int, hidden: int) -> bool:
    """Whether paging a causal attention output of rows of `seq` tokens saves at least as much recompute per
    byte as paging the MLP's gate product E, which offloaded checkpointing already does.

    A row's attention forward is about 2 S Hq D FLOPs (causal: half of 4 S Hq D), for Hq D x 2 bytes of
    output (and 4 Hq of logsumexp): about S FLOPs a byte. E's product is 2 H I FLOPs a row for I x 2
    bytes: H FLOPs a byte. So the output pays at least as well once S >= H, and better than that, as
    attention runs below the matrix products' rate."""
    return seq >= hidden


def causal_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> CausalKernels | None:
    """The kernels for these tensors: cuDNN's on CUDA where SDPA itself could train on cuDNN's attention
    (its own check, asked as for tensors that need gradients, so both passes of a layer get the same
    answer), the reference on the CPU (tests), None elsewhere (the caller then runs its own attention
    and keeps nothing)."""
    if q.device.type == "cpu":
        return REFERENCE_CAUSAL
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    return CUDNN_CAUSAL if _cudnn_trains(q, k, v) else None


def _cudnn_trains(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA could run causal attention of q, k, v, needing gradients, on cuDNN (head size,
    layout, GPU); False where torch's check cannot be asked."""
    graded = [t.detach().requires_grad_(True) for t in (q, k, v)]  # views: no copies
    try:
        params = torch.backends.cuda.SDPAParams(*graded, None, 0.0, True, q.shape[1] != k.shape[1])
        return bool(torch.backends.cuda.can_use_cudnn_attention(params, False))
    except (AttributeError, TypeError, RuntimeError):
        return False


def stored_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, store: AttentionStore, hidden: int,
) -> torch.Tensor | None:
    """Causal attention (B, Hq, S, D) through a checkpoint's `store`: a first pass (grad off) computes
    (out, lse) and keeps them; the recompute (grad on) takes them back and runs no forward
    (`KeptAttention`). None where these tensors have no kernel, or the first pass kept nothing: the
    caller then runs its own attention (the two passes of a layer agree, as a kept pair is taken
    only where it was kept). `hidden`: the model's hidden size, for the store's rule (`AttentionStore.admits`)."""
    kernels = causal_kernels(q, k, v)
    if kernels is None:
        return None
    if not torch.is_grad_enabled():
        if not store.admits(q.shape[2], q.shape[0] * q.shape[2], hidden, q.device):
            return None
        out, lse = kernels.forward(q, k, v, scale)
        store.keep(out, lse)
        return out
    kept = store.take()
    return None if kept is None else kept_attention(q, k, v, kept, scale, kernels)



def stored_qkv(
    x: torch.Tensor, layers: tuple[nn.Module, nn.Module, nn.Module], store: AttentionStore | None, admitted: bool,
) -> tuple[torch.Tensor, ...]:
    """(q, k, v) = the Q, K and V projections of x (..., hidden), through a checkpoint's `store` where it keeps
    them (`keep_qkv`): a first pass whose attention output will be kept (`admitted`, the store's own answer)
    keeps them; the recompute takes them back and runs none of their products, only their backward
    (`kestrel.kernels.lora_projections_known`: the three must be on the fused LoRA path; otherwise they run
    as they are, and the kept copies go unused)."""
    if store is None or not store.keeps_qkv:
        return project_together(x, *layers)
    if not torch.is_grad_enabled():  # the first pass
        q, k, v = project_together(x, *layers)
        if admitted:
            store.keep_qkv(q, k, v)
        return q, k, v
    known, weights = store.take_qkv(), [fused_lora_weights(layer) for layer in layers]
    if known is None or any(w is None for w in weights):
        return project_together(x, *layers)
    return lora_projections_known(x, tuple(weights), known)


def stored_projection(o_proj: nn.Module, x: torch.Tensor, store: AttentionStore) -> torch.Tensor:
    """o_proj(x) (..., hidden) of a layer whose attention output `store` kept (`stored_causal_attention` gave
    it): where the store keeps the projection's output too (`keep_projection`), the first pass keeps it and
    the recompute takes it back and runs no product for it, only its backward
    (`kestrel.kernels.lora_linear_known`: o_proj must be on the fused LoRA path; otherwise it runs
    as it is, and the kept copy goes unused)."""
    if not store.keeps_projection:
        return o_proj(x)
    if not torch.is_grad_enabled():  # the first pass
        y = o_proj(x)
        store.keep_projection(y)
        return y
    known, weights = store.take_projection(), fused_lora_weights(o_proj)
    if known is None or weights is None:
        return o_proj(x)
    return lora_linear_known(x, weights, known.view(*x.shape[:-1], known.shape[-1]))
