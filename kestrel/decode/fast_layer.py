"""The batch-1 decode layer as five launches, for Llama-style layers over a 16-bit base.

A layer of one token is four weight reads (q/k/v, o, gate/up, down); everything else is small
work between them, which as separate kernels costs about as much as the attention and norms
themselves (bench/RESULTS.md, Decode "Session 2"). Here each small op rides in the epilogue of
the product before it (`kestrel/kernels/decode/gemv_fused.py`):

    q, cache[col] <- qkv_rope_cache(u; ss)      input norm finished, q/k/v product, RoPE, K/V cached
    a             <- decode_attention(q, cache)  one launch, split over the cache, merged in place
    x, u; ss'     <- residual(a; x)              o product, + residual, post-attention norm begun
    m             <- glu(u; ss')                 that norm finished, gate/up product, SiLU(gate) * up
    x, u; ss''    <- residual(m; x)              down product, + residual, the NEXT layer's norm begun

The step starts with `embed_start` (the embedding row, the first norm begun, the step's sums
zeroed) and ends with lm_head's product, which finishes the final norm into float32 logits.
An unmerged adapter's shrink t = A h is split the same way as a norm: the launch that produces h
adds its rows' share into float32 partial sums, the consumer sums them and adds B t to its rows;
o's shrink and the first layer's q/k/v keep a small launch of their own.

When (`applies`): a CUDA (or forced-Triton) model, one row, no adapter or one for the call,
q/k/v and gate/up fused into one buffer each (fused.py), plain dense o and down without bias,
and a family without QK-norm, sandwich norms, Gemma's norm casting, attention softcapping or
sinks, or sparse MLP blocks (Llama, Mistral, Qwen2). Everything else takes `DecodeModel`'s
general step: same math, rounded to the model dtype between the small ops (the two agree to
bf16 rounding, not bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kestrel.kernels.decode.attention import decode_attention
from kestrel.kernels._utils import next_pow2
from kestrel.kernels.dispatch import use_triton
from kestrel.kernels.decode.gemv import gemv
from kestrel.kernels.decode.gemv_fused import embed_start, glu, qkv_rope_cache, residual

if TYPE_CHECKING:
    from kestrel.decode.adapters import LoraCall
    from kestrel.decode.cache import StaticKVCache
    from kestrel.decode.projections import ProjGroup
    from kestrel.decode.model import DecodeModel, Layer, Norm


def applies(model: DecodeModel, batch: int, lora: LoraCall | None) -> bool:
    """True when every layer of `model` can run `layer_step` for this call."""
    spec = model.spec
    if batch != 1 or (lora is not None and lora.index is None) or not use_triton(model.embed.weight):
        return False
    if spec.qk_norm or spec.sandwich_norm or spec.norm_casting != "llama" or model.attn_softcap is not None:
        return False
    if spec.activation != "swiglu" or spec.embed_scale or spec.logit_softcap_attr:
        return False
    if spec.moe is not None or spec.attention_sinks:  # sparse blocks and sinks run the general step
        return False
    head = model.lm_head
    if head.lora is not None or head.fused is not None or head.projs[0].weight is None:
        return False
    return all(_layer_fits(layer, model.dtype, lora) for layer in model.layers)


def _layer_fits(layer: Layer, dtype: torch.dtype, lora: LoraCall | None) -> bool:
    if layer.qkv.fused is None or layer.gate_up.fused is None:
        return False
    for group in (layer.o, layer.down):
        (proj,) = group.projs
        if proj.weight is None or proj.bias is not None or proj.weight.dtype != dtype or proj.weight.stride(1) != 1:
            return False
    return True


def _span(group: ProjGroup, lora: LoraCall | None) -> tuple[int, int] | None:
    return None if lora is None or group.lora is None else group.lora.span(lora)


_GROUPS = 4  # q/k/v, o, gate/up, down
# Rows of partial sums each group's producer spreads its atomics over: q/k/v's and gate/up's come
# from `residual` (1,024 programs at 8B), down's from `glu` (14,336 programs, one row each); o's
# t is one launch's output. Every consumer program reads all its group's rows, so fewer is
# cheaper there; too few make the producers' atomics queue. These counts were the fastest
# (`bench/decode_kernels.py`; bench/RESULTS.md, Decode "Session 4").
_SLOTS = (4, 1, 4, 16)
_ROWS = max(_SLOTS)  # rows allocated per group


@dataclass(frozen=True)
class _Adapted:
    """One group's adapter for this call: A (r, in) and pre-scaled B (out, r), column spans of
    the group's bank, and T (slots, width) float32, its partial sums of A h."""

    a: torch.Tensor
    b: torch.Tensor
    t: torch.Tensor


def scratch_floats(model: DecodeModel) -> int:
    """float32 scratch a step needs: a sum of squares per RMSNorm, then (for a model with
    adapters) _ROWS x width partial sums per layer and group, width the widest adapter span."""
    n_layers = len(model.layers)
    width = _width(model)
    return _norm_floats(n_layers) + (n_layers * _GROUPS * _ROWS * width if width else 0)


def _norm_floats(n_layers: int) -> int:
    return -(-(2 * n_layers + 1) // 32) * 32  # the partial sums start on a 128-byte line


def _width(model: DecodeModel) -> int:
    spans = [hi - lo for layer in model.layers for g in layer.groups
             if g.lora is not None for lo, hi in g.lora.spans.values()]
    return next_pow2(max(spans)) if spans else 0


def _adapted(model: DecodeModel, lora: LoraCall | None, partials: torch.Tensor | None) -> list[list]:
    """Per layer, per group (q/k/v, o, gate/up, down): its `_Adapted` for this call, or None."""
    out = []
    for i, layer in enumerate(model.layers):
        row = []
        for g, group in enumerate((layer.qkv, layer.o, layer.gate_up, layer.down)):
            span = _span(group, lora)
            if span is None:
                row.append(None)
                continue
            lo, hi = span
            row.append(_Adapted(group.lora.a[lo:hi], group.lora.b[:, lo:hi], partials[i, g, : _SLOTS[g]]))
        out.append(row)
    return out


def forward(
    model: DecodeModel,
    tok: torch.Tensor,
    col: torch.Tensor,
    pad: torch.Tensor,
    cache: StaticKVCache,
    counters: torch.Tensor,
    scratch: torch.Tensor,
    lora: LoraCall | None = None,
) -> torch.Tensor:
    """tok (1,) -> last-token logits (1, V) float32; K/V of the step written to cache column col.

    counters: int32 zeros, at least n_kv (the attention's; every launch leaves them zero).
    scratch: float32, `scratch_floats(model)`, zeroed here (by `embed_start`): the norms' sums
    of squares, then the adapters' partial sums.
    """
    n_layers = len(model.layers)
    sums = scratch[: 2 * n_layers + 1]
    partials, adapted = None, [[None] * _GROUPS] * n_layers
    if lora is not None and scratch.numel() > _norm_floats(n_layers):  # the model has adapters
        partials = scratch[_norm_floats(n_layers) :].view(n_layers, _GROUPS, _ROWS, -1)
        adapted = _adapted(model, lora, partials)
    x, u = embed_start(tok, model.embed.weight, model.layers[0].input_norm.weight, sums, partials)
    first = adapted[0][0]
    t0 = None if first is None else gemv(u, first.a, out_dtype=torch.float32)  # scaled by the consumer
    for i, layer in enumerate(model.layers):
        last = i + 1 == n_layers
        after = model.final_norm if last else model.layers[i + 1].input_norm
        x, u = layer_step(model, layer, after, x, u, col, pad, cache.k[i], cache.v[i], counters,
                          sums[2 * i : 2 * i + 3], adapted[i], None if last else adapted[i + 1][0], t0)
        t0 = None
    (head,) = model.lm_head.projs
    logits = gemv(u, head.weight, head.bias, norm=(sums[-1:], model.final_norm.eps), out_dtype=torch.float32)
    return logits.view(1, -1)


def _consume(ad: _Adapted | None, t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    return None if ad is None else (ad.b, ad.t if t is None else t)


def _produce(ad: _Adapted | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    return None if ad is None else (ad.a, ad.t)


def layer_step(
    model: DecodeModel,
    layer: Layer,
    after: Norm,
    x: torch.Tensor,
    u: torch.Tensor,
    col: torch.Tensor,
    pad: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    counters: torch.Tensor,
    sums: torch.Tensor,
    adapted: list = (None,) * _GROUPS,
    next_qkv: _Adapted | None = None,
    qkv_t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (H,) residual stream, u = w_in * x and sums[0] = sum(x^2) (its input norm in halves)
    -> (x', w_after * x'), with sums[2] = sum(x'^2); sums[1] takes the post-attention norm's.
    adapted: this layer's groups' adapters (`_adapted`); next_qkv: the next layer's q/k/v one,
    whose partial sums this layer's last launch adds; qkv_t: q/k/v's t when no launch before
    produced its partial sums (the first layer)."""
    ad_qkv, ad_o, ad_gu, ad_down = adapted
    fused = layer.qkv.fused
    cos, sin = model.rope[layer.rope]
    q = qkv_rope_cache(u, fused.base, fused.base_bias, cos, sin, col, pad, k_cache, v_cache, model.n_heads,
                       norm=(sums[0:1], layer.input_norm.eps), lora=_consume(ad_qkv, qkv_t))
    a = decode_attention(q[None], k_cache, v_cache, col, pad, layer.scaling, layer.window, counters=counters)
    a = a.view(-1)
    t_o = None if ad_o is None else gemv(a, ad_o.a, out_dtype=torch.float32)
    x, u = residual(a, layer.o.projs[0].weight, x, layer.post_attn_norm.weight, sums[1:2],
                    lora=_consume(ad_o, t_o), ahead=_produce(ad_gu))
    m = glu(u, layer.gate_up.fused.base, layer.gate_up.sizes[0], norm=(sums[1:2], layer.post_attn_norm.eps),
            lora=_consume(ad_gu), ahead=_produce(ad_down))
    return residual(m, layer.down.projs[0].weight, x, after.weight, sums[2:3], lora=_consume(ad_down),
                    ahead=_produce(next_qkv))
