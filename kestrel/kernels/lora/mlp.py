"""The LoRA MLP, Y = down(act(gate(X)) * up(X)), as one autograd Function with its backward by hand.

Each of gate, up and down is a LoRA projection over a 16-bit or NF4 base (`kestrel.kernels.lora.lora`, whose
helpers this builds on): one shrink product serves gate and up, the adapter gradients are formed
rank-first, and the GLU (SwiGLU or tanh-GELU GeGLU, `kestrel.kernels.glu`) is recomputed in backward
rather than saved.

A checkpointed layer's recompute (`discard_output=True`) throws the output values away, so the
down product is skipped. Where it saves memory (long sequences) it goes further and runs nothing
in its forward: the whole MLP, forward and backward, runs inside the backward
(`_deferred_backward`) in chunks of rows, over gate's and up's merged weights W' formed once for
both the forward products and the input gradient. Its (rows, I) intermediates then no longer grow
with the sequence (at 400K tokens of the Llama-8B shape, E, G and h alone are 33 GiB).

Over a 16-bit base (adapters unmerged), where the Triton kernels run, gate's and up's expansions
s (X A^T) B^T are added inside the GLU rather than into E and G (`kestrel.kernels.glu_lowrank`):
E and G then hold the base products alone, and the GLU's forward and backward add the rank-r terms
as they read them, so no (M, I) pass is spent on the expansions (`_rank_terms`).

A checkpoint may also hand the MLP a `GateStore` (offloaded checkpointing, `kestrel.recompute.checkpoint`):
the first pass gives it the gate product E, and the recompute takes E back instead of computing
it, so the recompute skips the largest product it has left (the up product and the shrink
products still run: G, and X A^T for the adapter gradients).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch

from kestrel.constants import DEFERRED_ROWS
from kestrel.kernels import glu, glu_lowrank, nf4
from kestrel.kernels.lora import lora as base
from kestrel.kernels.dispatch import use_triton
from kestrel.kernels.lora.lora import _FIELDS, LoRAWeights
from kestrel.kernels.lora.casts import cast, mm_to

Activation = Literal["swiglu", "geglu"]

# Rows of X per chunk of a deferred MLP. 2,048 keeps the (rows, I) products in cuBLAS's
# efficient range (at the Llama-8B MLP, 2048 x 14336 x 4096 fills several waves of output tiles
# on a large GPU) and E, G and h/dh at 168 MiB there, however long the sequence.
_FIRST = 6  # gate's fields in the flattened argument list: after x, activation, discard, grad, store, policy
_DOWN = _FIRST + 2 * _FIELDS  # down's fields


class DeferPolicy(Protocol):
    """Whether a recompute's MLP of `rows` rows defers to its backward (`kestrel.recompute.mlp_deferral`
    holds a run's); it must answer the same for a layer's first pass and its recompute."""

    def defers(self, rows: int, gate: LoRAWeights, up: LoRAWeights, device: torch.device) -> bool: ...


class GateStore(Protocol):
    """Keeps a checkpointed layer's gate product E (M, I) from its first pass to its recompute,
    somewhere other than the GPU's memory (`kestrel.recompute.checkpoint` pages it to host memory)."""

    def target(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where the first pass may write E straight away (then handed to `keep` as it is), or
        None: E goes to a new tensor."""

    def keep(self, e: torch.Tensor) -> None:
        """Called once in the first pass with E; E's memory is the caller's again on return
        (the store copies it, in stream order)."""

    def take(self) -> torch.Tensor | None:
        """E back on E's device for the recompute (a tensor the MLP may overwrite), or None
        when nothing was kept (the recompute then computes E)."""


def glu_backward_reference(
    e: torch.Tensor, g: torch.Tensor, dh: torch.Tensor, activation: Activation
) -> tuple[torch.Tensor, torch.Tensor]:
    """For h = act(e) * g: de = dh * g * act'(e), dg = dh * act(e), written over (e, g) and
    returned. fp32 math; act(e) rounded to e's dtype first, as HF (and kestrel.kernels.glu) do."""
    de, dg = glu.glu_grads_reference(e.float(), g.float(), dh.float(), activation == "geglu", e.dtype)
    return e.copy_(de), g.copy_(dg)


# The adapters' terms of gate and up when the GLU adds them itself: ((U_e, U_g), (V_e, V_g)) (`_rank_terms`)
RankTerms = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _glu_forward(e: torch.Tensor, g: torch.Tensor, activation: Activation, rank: RankTerms | None = None) -> torch.Tensor:
    """h = act(e) * g (M, I) through kestrel.kernels.glu (Triton on CUDA, its reference elsewhere); with
    `rank`, act(e + U_e V_e^T) * (g + U_g V_g^T) (`kestrel.kernels.glu_lowrank`)."""
    if rank is not None:
        return glu_lowrank.glu_lowrank(e, g, *rank, gelu=activation == "geglu")
    return glu.swiglu(e, g) if activation == "swiglu" else glu.geglu(e, g)


def _glu_backward_(
    e: torch.Tensor, g: torch.Tensor, dh: torch.Tensor, activation: Activation, rank: RankTerms | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(de, dg) written over (e, g): kestrel.kernels.glu's in-place Triton backward, or the reference; with
    `rank`, the gradients of e + U_e V_e^T and g + U_g V_g^T (`kestrel.kernels.glu_lowrank`)."""
    if rank is not None:
        return glu_lowrank.glu_lowrank_backward_(dh, e, g, *rank, gelu=activation == "geglu")
    if use_triton(e, g, dh):
        return glu.glu_backward(dh, e, g, gelu=activation == "geglu", inplace=True)
    return glu_backward_reference(e, g, dh, activation)


def _rank_terms(
    x: torch.Tensor, xa: torch.Tensor | None, gate: LoRAWeights, up: LoRAWeights, dtype: torch.dtype, merged: bool,
) -> RankTerms | None:
    """The terms for the GLU to add, where it adds them: gate's and up's adapters unmerged (a 16-bit base) and
    on, their shrink product `xa` = [s_g x A_g^T | s_u x A_u^T] (M, 2r) formed, and the Triton kernels running.
    Then E and G hold the base products alone and the expansions never make (M, I) passes of their own
    (`kestrel.kernels.glu_lowrank`); elsewhere (None) E and G hold the whole projections. A layer's passes
    (first, recompute, backward) answer alike, so a gate product kept by a `GateStore` means the same to each."""
    if merged or xa is None or (gate.adapter_off and up.adapter_off) or not use_triton(x):
        return None
    sg, su = base._spans([gate, up])
    return (xa[:, sg], xa[:, su]), (cast(gate.lora_B, dtype), cast(up.lora_B, dtype))


class _LoRAMLP(torch.autograd.Function):
    """Y = down(h), h = act(E) * G, E = gate(X), G = up(X); each of gate/up/down a LoRA
    projection (`kestrel.kernels.lora.lora`). X (M, H), E, G, h (M, I), Y (M, H).

    Forward saves X, E, G and the rank-r products [s_g X A_g^T | s_u X A_u^T] (one shrink
    product for gate and up) and s_d h A_d^T; h is NOT saved (recomputed in backward).
    Backward, given dY (M, H):

        dYBd = s_d dY B_d                         (M, r)
        dB_d = dY^T (s_d h A_d^T)                 (H, r)
        h    = act(E) * G                         (recomputed; freed right after its one use)
        dA_d = dYBd^T h                           (r, I)
        dh   = dY W_d + dYBd A_d                  (M, I)
        dE   = dh * G * act'(E)                   (written over E)
        dG   = dh * act(E)                        (written over G)
        [dA_g; dA_u] = [s_g dE B_g | s_u dG B_u]^T X           (one product)
        dB_g = dE^T (s_g X A_g^T),   dB_u = dG^T (s_u X A_u^T)
        dX   = [s_g dE B_g | s_u dG B_u] [A_g; A_u] + dE W_g + dG W_u   (one (M, H) buffer)

    act is SiLU (swiglu) or tanh-GELU (geglu). Only one dequantized base weight lives at a
    time (three when deferred), and at most three (M, I) tensors (E, G, then h or dh; deferred:
    three (chunk rows, I)). E and G are overwritten, so
    backward runs once (retain_graph and a second backward raises).

    `discard`: the caller throws Y's values away and only back-propagates through it (a
    checkpointed layer's recompute, where Y goes straight into the residual sum): the down
    product is skipped (Y's values are unspecified) and h is kept for backward instead of
    recomputed (backward frees it before dh exists, so the peak is unchanged). `store`: a
    first pass without autograd gives it E, and a recompute takes E from it. Where deferring
    lowers the peak (`DeferPolicy`, by default `lowers_peak`), the forward saves X alone and computes nothing, and the
    backward runs the forward and the backward above together, chunk by chunk
    (`_deferred_backward`).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, activation: Activation, discard: bool, grad: bool,
        store: GateStore | None, policy: DeferPolicy | None, *flat: Any,
    ) -> torch.Tensor:
        gate, up, down = base._unflatten(flat)
        dtype, lead = base._compute_dtype(x), x.shape[:-1]
        ctx.activation, ctx.dtype, ctx.x_dtype, ctx.x_shape = activation, dtype, x.dtype, x.shape
        ctx.done, ctx.h, ctx.rank_in_glu = False, None, False
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (M, H)
            ctx.deferred = discard and grad and _defers(policy, x2.shape[0], gate, up, x.device)
            if ctx.deferred:
                base._save(ctx, (gate, up, down), x2)
                y = _unspecified(x2.shape[0], down.out_features, dtype, x.device)
            else:
                y = _forward(ctx, x2, (gate, up, down), activation, dtype, grad, discard, store, policy)
        # Not a view of y: a view made inside a Function cannot be updated in place downstream.
        return torch.ops.aten._unsafe_view(y, (*lead, down.out_features))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.done:
            raise RuntimeError("lora_mlp backward overwrites its saved activations: it runs once")
        ctx.done = True
        grads: list[torch.Tensor | None] = [None] * (_FIRST + _FIELDS * 3)
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1]).to(ctx.dtype)  # (M, H)
            dx = (_deferred_backward if ctx.deferred else _backward)(ctx, dy2, grads)
        if dx is not None:
            grads[0] = dx.view(ctx.x_shape).to(ctx.x_dtype)
        return tuple(grads)


def _unspecified(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (rows, cols) output whose values nobody reads: one element broadcast (no memory), where
    a real buffer would be one more (tokens, hidden) tensor alive through the layer's backward."""
    return torch.empty((), dtype=dtype, device=device).expand(rows, cols)


def extra_bytes(rows: int, inter: int, dense: int, itemsize: int = 2) -> int:
    """Bytes a recompute that keeps E, G and h for all `rows` (rows, I) holds beyond a deferred one,
    which holds three (min(rows, DEFERRED_ROWS), I) chunks plus `dense` weight elements (gate's and
    up's merged W', `dense_elements`)."""
    return itemsize * (3 * rows * inter - 3 * min(rows, DEFERRED_ROWS) * inter - dense)


def dense_elements(gate: LoRAWeights, up: LoRAWeights) -> int:
    """Weight elements a deferred MLP keeps dense: gate's and up's where the base is NF4 (merged
    or dequantized copies; a 16-bit base is used as it is)."""
    return sum(w.out_features * w.in_features for w in (gate, up) if w.quant_state is not None)


def lowers_peak(rows: int, gate: LoRAWeights, up: LoRAWeights) -> bool:
    """Whether deferring lowers the MLP recompute's peak at all (`extra_bytes` > 0): the rule
    without a `DeferPolicy`."""
    return extra_bytes(rows, gate.out_features, dense_elements(gate, up)) > 0


def _defers(policy: DeferPolicy | None, rows: int, gate: LoRAWeights, up: LoRAWeights, device: torch.device) -> bool:
    return lowers_peak(rows, gate, up) if policy is None else policy.defers(rows, gate, up, device)


def _forward(
    ctx: Any, x2: torch.Tensor, ws: tuple[LoRAWeights, LoRAWeights, LoRAWeights],
    activation: Activation, dtype: torch.dtype, grad: bool, discard: bool, store: GateStore | None,
    policy: DeferPolicy | None = None,
) -> torch.Tensor:
    """The forward of `_LoRAMLP` (not deferred): Y (M, H), or unspecified values when
    `discard`; saves for `_backward` when `grad`. E comes from `store` in a recompute that
    finds it kept there, and goes to it in a first pass whose recompute will not defer."""
    gate, up, down = ws
    sg, su = base._spans([gate, up])
    merged_gu, merged_d = base._merges([gate, up]), base._merges([down])
    xa_gu = ha_d = a_d = None  # the rank-r pieces: for backward, or unmerged expands
    a_gu = base._stacked_a([gate, up], dtype)  # (2r, H)
    if base._needs_shrink(grad, merged_gu, (gate, up)):
        xa_gu = base._shrink(x2, [gate, up], a_gu)  # (M, 2r)
    xa_g, xa_u = (None, None) if xa_gu is None else (xa_gu[:, sg], xa_gu[:, su])
    rank = _rank_terms(x2, xa_gu, gate, up, dtype, merged_gu)  # None: E and G carry their adapters
    e = store.take() if store is not None and grad else None
    if e is None:
        keep = store is not None and not grad and not _defers(policy, x2.shape[0], gate, up, x2.device)
        into = store.target((x2.shape[0], gate.out_features), dtype) if keep else None
        e = base._expand(x2, xa_g, gate, dtype, merged_gu, a=a_gu[sg], out=into, adapter=rank is None)  # (M, I)
        if keep:
            store.keep(e)
    g = base._expand(x2, xa_u, up, dtype, merged_gu, a=a_gu[su], adapter=rank is None)
    h = _glu_forward(e, g, activation, rank)
    if base._needs_shrink(grad, merged_d or discard, (down,)):  # for backward, or for the down product
        a_d = cast(down.lora_A, dtype)  # (r, I)
        ha_d = base._shrink(h, [down], a_d)  # (M, r)
    if discard:
        y = _unspecified(x2.shape[0], down.out_features, dtype, x2.device)
    else:
        y = base._expand(h, ha_d, down, dtype, merged_d)  # (M, H)
    if grad:
        base._save(ctx, (gate, up, down), x2, e, g, xa_gu, a_gu, ha_d, a_d)
        ctx.h = h if discard else None
        ctx.rank_in_glu = rank is not None
    return y


def _backward(ctx: Any, dy: torch.Tensor, grads: list[torch.Tensor | None]) -> torch.Tensor | None:
    """`_LoRAMLP`'s backward from what `_forward` saved; returns dX (M, H) or None."""
    x2, e, g, xa_gu, a_gu, ha_d, a_d, *tensors = ctx.saved_tensors
    gate, up, down = base._rebuild(tensors, ctx.meta)
    dtype = ctx.dtype
    rank = _rank_terms(x2, xa_gu, gate, up, dtype, False) if ctx.rank_in_glu else None
    dyb = base._adapter_backward(ctx, _DOWN, [dy], None, ha_d, [down], dtype, grads)  # (M, r); dB_d
    if base._needs(ctx, _DOWN, 0)[0]:
        h = ctx.h if ctx.h is not None else _glu_forward(e, g, ctx.activation, rank)
        grads[_DOWN + 2] = mm_to(dyb.t(), h, down.lora_A.dtype)
        del h
    ctx.h = None
    dh = base._input_backward([dy], dyb, a_d, [down], dtype)
    de, dg = _glu_backward_(e, g, dh, ctx.activation, rank)
    del dh
    return base._group_backward(ctx, _FIRST, [de, dg], x2, xa_gu, a_gu, [gate, up], dtype, grads)


def _deferred_backward(ctx: Any, dy: torch.Tensor, grads: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Forward and backward of the MLP together, from X alone, in chunks of DEFERRED_ROWS rows
    (the adapter gradients summed over chunks). Per chunk, the forward and the backward of the
    `_LoRAMLP` docstring, except that with merged NF4 bases dX = dE W'_g + dG W'_u over the
    W' formed once for the forward products (`kestrel.kernels.lora.lora._input_backward`). W_d is
    dequantized once, into the shared workspace, which nothing else uses until the end."""
    x2, *tensors = ctx.saved_tensors
    gate, up, down = base._rebuild(tensors, ctx.meta)
    dtype, merged = ctx.dtype, base._merges([gate, up])
    a_gu, a_d = base._stacked_a([gate, up], dtype), cast(down.lora_A, dtype)  # (2r, H), (r, I)
    dense = [_own_dense(w, dtype, merged, a_gu[span]) for w, span in zip((gate, up), base._spans([gate, up]))]
    w_d = base._base(down.weight, down.quant_state, dtype)  # (H, I)
    dx = torch.empty_like(x2) if ctx.needs_input_grad[0] else None
    for start in range(0, x2.shape[0], DEFERRED_ROWS):
        rows = slice(start, start + DEFERRED_ROWS)
        chunk: list[torch.Tensor | None] = [None] * len(grads)
        out = None if dx is None else dx[rows]
        _chunk_backward(ctx, x2[rows], dy[rows], (gate, up, down), dense, merged, (a_gu, a_d, w_d), chunk, out)
        for i, t in enumerate(chunk):
            if t is not None:
                grads[i] = t if grads[i] is None else grads[i].add_(t)
    return dx


def _own_dense(w: LoRAWeights, dtype: torch.dtype, merged: bool, a: torch.Tensor) -> torch.Tensor:
    """W (out, in) in `dtype` in a buffer of its own, not the shared workspace (W' = W + s B A
    when `merged`, `a` being A cast to `dtype`); a 16-bit base is used as it is."""
    if w.quant_state is None:
        return base._base(w.weight, None, dtype)
    out = torch.empty((w.out_features, w.in_features), dtype=dtype, device=w.weight.device)
    if merged:
        return base._merged(w, dtype, out, a)
    return nf4.dequantize(w.weight, w.quant_state, out=out)


def _chunk_backward(
    ctx: Any, x: torch.Tensor, dy: torch.Tensor, ws: tuple[LoRAWeights, LoRAWeights, LoRAWeights],
    dense: list[torch.Tensor], merged: bool, parts: tuple[torch.Tensor, ...],
    grads: list[torch.Tensor | None], out: torch.Tensor | None,
) -> None:
    """One chunk of `_deferred_backward`: x (m, H), dy (m, H); this chunk's adapter gradients
    into `grads`, its dX into `out` (when given). dense: W_g, W_u (W'_g, W'_u when `merged`);
    parts: a_gu (2r, H), a_d (r, I), W_d (H, I)."""
    gate, up, down = ws
    a_gu, a_d, w_d = parts
    dtype, (sg, su) = ctx.dtype, base._spans([gate, up])
    xa = base._shrink(x, [gate, up], a_gu)  # (m, 2r)
    rank = _rank_terms(x, xa, gate, up, dtype, merged)  # None: E and G carry their adapters
    e = base._expand(x, xa[:, sg], gate, dtype, merged, dense[0], adapter=rank is None)  # (m, I)
    g = base._expand(x, xa[:, su], up, dtype, merged, dense[1], adapter=rank is None)
    h = _glu_forward(e, g, ctx.activation, rank)
    dyb = base._adapter_backward(ctx, _DOWN, [dy], h, base._shrink(h, [down], a_d), [down], dtype, grads)
    del h
    dh = torch.mm(dyb, a_d).addmm_(dy, w_d)  # (m, I)
    de, dg = _glu_backward_(e, g, dh, ctx.activation, rank)
    del dh
    base._group_backward(ctx, _FIRST, [de, dg], x, xa, a_gu, [gate, up], dtype, grads, dense, merged, out)


def lora_mlp(
    x: torch.Tensor,
    gate: LoRAWeights,
    up: LoRAWeights,
    down: LoRAWeights,
    activation: Activation = "swiglu",
    discard_output: bool = False,
    gate_store: GateStore | None = None,
    defer: DeferPolicy | None = None,
) -> torch.Tensor:
    """x (..., H) -> down(act(gate(x)) * up(x)) (..., H), one autograd Function (see _LoRAMLP).
    discard_output=True: the output's VALUES are unspecified (the down product is skipped, or
    everything deferred to the backward) and only its gradient path is real; for a checkpoint's
    recompute whose output is thrown away. gate_store: where a checkpoint's first pass keeps
    the gate product E and its recompute takes it back (`GateStore`); both passes get the same
    store, and the recompute must see the same input as the first pass. defer: whether a recompute
    of these rows defers to its backward (`DeferPolicy`; None: wherever that lowers its peak)."""
    if activation not in ("swiglu", "geglu"):
        raise ValueError(f"activation must be 'swiglu' or 'geglu', got {activation!r}")
    if any(w.bias is not None for w in (gate, up, down)):
        raise ValueError("lora_mlp takes bias-free projections: run a biased MLP's projections one by one "
                         "(lora_linear each)")
    grad = base._will_backward(x, [gate, up, down])
    return _LoRAMLP.apply(
        x, activation, discard_output, grad, gate_store, defer, *gate._flat(), *up._flat(), *down._flat()
    )
