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

When (`applies`): a CUDA (or forced-Triton) model, one row, no adapter in this call, q/k/v and
gate/up fused into one buffer each (fused.py), plain dense o and down without bias, and a
family without QK-norm, sandwich norms, Gemma's norm casting or attention softcapping (Llama,
Mistral, Qwen2). Everything else takes `DecodeModel`'s general step: same math, rounded to the
model dtype between the small ops, where these kernels round once (so the two agree to bf16
rounding, not bit for bit). An unmerged adapter takes the general step too: its expand needs the
whole shrink product before any output row is final.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.decode_attention import decode_attention
from kernels.dispatch import use_triton
from kernels.gemv import gemv
from kernels.gemv_fused import embed_start, glu, qkv_rope_cache, residual

if TYPE_CHECKING:
    from engine.decode.cache import StaticKVCache
    from engine.decode.model import DecodeModel, Layer, Norm


def applies(model: DecodeModel, batch: int, lora: object | None) -> bool:
    """True when every layer of `model` can run `layer_step` for this call."""
    spec = model.spec
    if batch != 1 or lora is not None or not use_triton(model.embed.weight):
        return False
    if spec.qk_norm or spec.sandwich_norm or spec.norm_casting != "llama" or model.attn_softcap is not None:
        return False
    if spec.activation != "swiglu" or spec.embed_scale or spec.logit_softcap_attr:
        return False
    head = model.lm_head
    if head.lora is not None or head.fused is not None or head.projs[0].weight is None:
        return False
    return all(_layer_fits(layer, model.dtype) for layer in model.layers)


def _layer_fits(layer: Layer, dtype: torch.dtype) -> bool:
    if layer.qkv.fused is None or layer.gate_up.fused is None:
        return False
    for group in (layer.o, layer.down):
        (proj,) = group.projs
        if proj.weight is None or proj.bias is not None or proj.weight.dtype != dtype or proj.weight.stride(1) != 1:
            return False
    return True


def forward(
    model: DecodeModel,
    tok: torch.Tensor,
    col: torch.Tensor,
    pad: torch.Tensor,
    cache: StaticKVCache,
    counters: torch.Tensor,
    sums: torch.Tensor,
) -> torch.Tensor:
    """tok (1,) -> last-token logits (1, V) float32; K/V of the step written to cache column col.

    counters: int32 zeros, at least n_kv (the attention's; every launch leaves them zero).
    sums: float32, 2 * layers + 1 (one sum of squares per RMSNorm), zeroed by `embed_start`.
    """
    x, u = embed_start(tok, model.embed.weight, model.layers[0].input_norm.weight, sums)
    for i, layer in enumerate(model.layers):
        after = model.layers[i + 1].input_norm if i + 1 < len(model.layers) else model.final_norm
        x, u = layer_step(model, layer, after, x, u, col, pad, cache.k[i], cache.v[i], counters, sums[2 * i : 2 * i + 3])
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (H,) residual stream, u = w_in * x and sums[0] = sum(x^2) (its input norm in halves)
    -> (x', w_after * x'), with sums[2] = sum(x'^2); sums[1] takes the post-attention norm's."""
    fused = layer.qkv.fused
    cos, sin = model.rope[layer.rope]
    q = qkv_rope_cache(u, fused.base, fused.base_bias, cos, sin, col, pad, k_cache, v_cache, model.n_heads,
                       norm=(sums[0:1], layer.input_norm.eps))
    a = decode_attention(q[None], k_cache, v_cache, col, pad, layer.scaling, layer.window, counters=counters)
    x, u = residual(a.view(-1), layer.o.projs[0].weight, x, layer.post_attn_norm.weight, sums[1:2])
    m = glu(u, layer.gate_up.fused.base, layer.gate_up.sizes[0], norm=(sums[1:2], layer.post_attn_norm.eps))
    return residual(m, layer.down.projs[0].weight, x, after.weight, sums[2:3])
