"""The batch-1 decode layer as five launches, for Llama-style layers over a 16-bit base.

A layer of one token is four weight reads (q/k/v, o, gate/up, down); everything else is small
work between them, which as separate kernels cost about as much time as the attention and norms
themselves need (bench/RESULTS.md: ~25 us a layer outside the products on an H200). Here each
small op rides in the epilogue of the product before it (`kernels/gemv_fused.py`):

    q, cache[col] <- qkv_rope_cache(u; ss)      input norm finished, q/k/v product, RoPE, K/V cached
    a             <- decode_attention(q, cache)  one launch, split over the cache, merged in place
    x, u; ss'     <- residual(a; x)              o product, + residual, post-attention norm begun
    m             <- glu(u; ss')                 that norm finished, gate/up product, SiLU(gate) * up
    x, u; ss''    <- residual(m; x)              down product, + residual, the NEXT layer's norm begun

The step starts with one launch (`embed_start`: the embedding row, the first norm begun, the
step's sums zeroed) and ends with lm_head's product, which finishes the final norm and writes
float32 logits. An RMSNorm is split across a launch boundary: `residual` writes u = w * x and adds sum(x^2) into
a float32 slot; the consumer scales its float32 product sums by rsqrt(ss / H + eps).

When (`applies`): a CUDA (or forced-Triton) model, one row, no adapter or one adapter for the
call (not per-row mixing), q/k/v and
gate/up fused into one buffer each (fused.py), plain dense o and down without bias, and a
family without QK-norm, sandwich norms, Gemma's norm casting or attention softcapping (Llama,
Mistral, Qwen2). Everything else takes `DecodeModel`'s general step: same math, rounded to the
model dtype between the small ops, where these kernels round once (so the two agree to bf16
rounding, not bit for bit). An unmerged adapter adds one small launch per group it targets, the
shrink t = A h (its A rows sit after the base rows in the fused buffer), and the product's
epilogue adds B t to its rows; the shrink cannot share the product's launch because every
output row needs all of t.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.decode_attention import decode_attention
from kernels.dispatch import use_triton
from kernels.gemv import gemv
from kernels.gemv_fused import embed_start, glu, qkv_rope_cache, residual

if TYPE_CHECKING:
    from engine.decode.adapters import LoraCall
    from engine.decode.cache import StaticKVCache
    from engine.decode.projections import ProjGroup
    from engine.decode.model import DecodeModel, Layer, Norm


def applies(model: DecodeModel, batch: int, lora: LoraCall | None) -> bool:
    """True when every layer of `model` can run `layer_step` for this call."""
    spec = model.spec
    if batch != 1 or (lora is not None and lora.index is None) or not use_triton(model.embed.weight):
        return False
    if spec.qk_norm or spec.sandwich_norm or spec.norm_casting != "llama" or model.attn_softcap is not None:
        return False
    if spec.activation != "swiglu" or spec.embed_scale or spec.logit_softcap_attr:
        return False
    head = model.lm_head
    if head.lora is not None or head.fused is not None or head.projs[0].weight is None:
        return False
    return all(_layer_fits(layer, model.dtype, lora) for layer in model.layers)


def _layer_fits(layer: Layer, dtype: torch.dtype, lora: LoraCall | None) -> bool:
    if layer.qkv.fused is None or layer.gate_up.fused is None:
        return False
    for group in (layer.qkv, layer.o, layer.gate_up, layer.down):
        if _span(group, lora) is not None and group.fused is None:
            return False  # the shrink reads the adapter's A rows from the fused buffer
    for group in (layer.o, layer.down):
        (proj,) = group.projs
        if proj.weight is None or proj.bias is not None or proj.weight.dtype != dtype or proj.weight.stride(1) != 1:
            return False
    return True


def _span(group: ProjGroup, lora: LoraCall | None) -> tuple[int, int] | None:
    return None if lora is None or group.lora is None else group.lora.span(lora)


def _shrink(group: ProjGroup, lora: LoraCall | None, u: torch.Tensor, norm: tuple[torch.Tensor, float] | None):
    """(B, t) for the kernels' `lora` argument, or None: t = A_span h (r,), one small launch,
    h = the group's normed input (finished from `norm` as the products do); B pre-scaled."""
    span = _span(group, lora)
    if span is None:
        return None
    lo, hi = span
    fused = group.fused
    return group.lora.b[:, lo:hi], gemv(u, fused.weight[fused.n + lo : fused.n + hi], norm=norm)


def forward(
    model: DecodeModel,
    tok: torch.Tensor,
    col: torch.Tensor,
    pad: torch.Tensor,
    cache: StaticKVCache,
    counters: torch.Tensor,
    sums: torch.Tensor,
    lora: LoraCall | None = None,
) -> torch.Tensor:
    """tok (1,) -> last-token logits (1, V) float32; K/V of the step written to cache column col.

    counters: int32 zeros, at least n_kv (the attention's; every launch leaves them zero).
    sums: float32, 2 * layers + 1 (one sum of squares per RMSNorm), zeroed by `embed_start`.
    """
    x, u = embed_start(tok, model.embed.weight, model.layers[0].input_norm.weight, sums)
    for i, layer in enumerate(model.layers):
        after = model.layers[i + 1].input_norm if i + 1 < len(model.layers) else model.final_norm
        x, u = layer_step(model, layer, after, x, u, col, pad, cache.k[i], cache.v[i], counters,
                          sums[2 * i : 2 * i + 3], lora)
    (head,) = model.lm_head.projs
    logits = gemv(u, head.weight, head.bias, norm=(sums[-1:], model.final_norm.eps), out_dtype=torch.float32)
    return logits.view(1, -1)


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
    lora: LoraCall | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (H,) residual stream, u = w_in * x and sums[0] = sum(x^2) (its input norm in halves)
    -> (x', w_after * x'), with sums[2] = sum(x'^2); sums[1] takes the post-attention norm's.
    An adapter call adds one shrink launch per group it targets (`_shrink`)."""
    fused = layer.qkv.fused
    cos, sin = model.rope[layer.rope]
    norm_in = (sums[0:1], layer.input_norm.eps)
    q = qkv_rope_cache(u, fused.base, fused.base_bias, cos, sin, col, pad, k_cache, v_cache, model.n_heads,
                       norm=norm_in, lora=_shrink(layer.qkv, lora, u, norm_in))
    a = decode_attention(q[None], k_cache, v_cache, col, pad, layer.scaling, layer.window, counters=counters)
    a = a.view(-1)
    x, u = residual(a, layer.o.projs[0].weight, x, layer.post_attn_norm.weight, sums[1:2],
                    lora=_shrink(layer.o, lora, a, None))
    norm_mid = (sums[1:2], layer.post_attn_norm.eps)
    m = glu(u, layer.gate_up.fused.base, layer.gate_up.sizes[0], norm=norm_mid,
            lora=_shrink(layer.gate_up, lora, u, norm_mid))
    return residual(m, layer.down.projs[0].weight, x, after.weight, sums[2:3], lora=_shrink(layer.down, lora, m, None))
