"""Kestrel's own forward for decoding, reading the weights of a loaded Hugging Face model.

Nothing is copied: every weight is the model's own tensor (the LoRA bank holds small copies of
the adapters, see `adapters.py`). Where safe, each layer's q/k/v and gate/up weights are
re-pointed into one buffer per group, so each group runs as one product (`fused.py`,
`projections.py`; `fuse=False` keeps them separate; `unfuse()` gives the model separate storage
back). One `DecodeModel` covers every registered family; the family differences come from
`kestrel.model.registry.FamilySpec`:

    Llama / Mistral / Qwen2   x -> norm -> attn -> +x -> norm -> SwiGLU MLP -> +x
    Qwen3                     + RMSNorm over head_dim on q and k before RoPE (QK-norm)
    Gemma 3                   + QK-norm, (1 + w) norms cast after the scale, embeddings times
                              sqrt(hidden), sandwich norms around attention and MLP, GeGLU,
                              sliding-window layers with their own RoPE, final logit softcap
    Qwen3-MoE                 Qwen3's attention; the MLP a sparse block (router, top-k experts,
                              `moe.py`), dense in `mlp_only_layers`
    gpt-oss                   biased q/k/v/o, attention sinks (one more softmax logit per head,
                              value 0), alternating sliding-window layers, half-width RoPE
                              tables, norms cast after the scale; every MLP a sparse block with
                              biased experts and a clamped GLU

Two entry points, both returning only the last token's logits (B, V) in float32:
- `prefill(ids, pad, cache, lora)`: the whole (left-padded) prompt at once, SDPA attention (the
  sink softmax over query chunks where the family has sinks), K/V written to cache columns [0, T);
- `step(tok, col, pad, cache, lora)`: one token per row at cache column `col` (a (1,) device
  tensor). Fixed shapes, no host reads: the function the generator compiles and graph-captures.
  Attention reads the cache in one kernel (`kestrel.kernels.decode.attention`); batch 1 without an
  adapter runs `fast_layer.py`'s five launches a layer where the family allows. NF4 (QLoRA)
  bases read their packed weights in one launch per group at 2-16 rows (`projections.py`).

RoPE positions: a row's token at column c has position c - pad[row]; cos/sin come from tables
built once by the model's own rotary module (so every RoPE scaling variant matches HF).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.decode import fast_layer
from kestrel.decode.adapters import LoraCall, adapter_names, build_group, is_lora_layer
from kestrel.decode.cache import StaticKVCache
from kestrel.decode.fused import fuse_allowed, tied_parameters
from kestrel.decode.moe import MoeBlock, is_sparse, moe_block, unreadable
from kestrel.decode.projections import ProjGroup, base_module, make_group
from kestrel.errors import KestrelError
from kestrel.model.multimodal import language_stack
from kestrel.model.attention import sink_softmax_attention
from kestrel.model.registry import FamilySpec, family_for, logit_softcap, text_config
from kestrel.kernels.decode import nf4_gemv
from kestrel.kernels.decode.attention import decode_attention
from kestrel.kernels.dispatch import use_triton
from kestrel.kernels.rms_norm import rms_norm
from kestrel.kernels.rope import rope_


class UnsupportedModelError(KestrelError, ValueError):
    """The model's family has no decode path (see `kestrel.model.registry.SUPPORTED`)."""


@dataclass
class Norm:
    weight: torch.Tensor
    eps: float


def _norm(module: nn.Module | None) -> Norm | None:
    if module is None:
        return None
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    return Norm(module.weight, float(eps))


@dataclass
class Layer:
    qkv: ProjGroup
    o: ProjGroup
    gate_up: ProjGroup | None  # None in a sparse layer (`moe`)
    down: ProjGroup | None
    act: Callable[[torch.Tensor], torch.Tensor] | None
    input_norm: Norm
    post_attn_norm: Norm
    pre_ff_norm: Norm | None  # sandwich-norm families only
    post_ff_norm: Norm | None
    q_norm: Norm | None  # QK-norm families only
    k_norm: Norm | None
    scaling: float
    window: int | None  # sliding-window size (keys with q_pos - k_pos < window), None = full
    rope: str  # key into DecodeModel.rope
    moe: MoeBlock | None = None  # the sparse MLP (mixture-of-experts families), else gate_up/down
    sinks: torch.Tensor | None = None  # (n_heads,) attention-sink logits (gpt-oss)

    @property
    def groups(self) -> tuple[ProjGroup, ...]:
        """The layer's linear projection groups: q/k/v, o, then gate/up and down unless sparse."""
        return (self.qkv, self.o) if self.moe is not None else (self.qkv, self.o, self.gate_up, self.down)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecodeModel:
    """The decode forward over a loaded Hugging Face causal LM (see the module docstring)."""

    def __init__(self, model: nn.Module, max_seq_len: int, fuse: bool | None = None) -> None:
        """`fuse`: None = where safe (frozen base or eval mode, see fused.py), True/False force."""
        self.model, self.fuse_setting = model, fuse
        self._unfused_by_request = False
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        spec = family_for(lm.config)
        if spec is None or not spec.decode:
            raise UnsupportedModelError(f"no decode path for model type {lm.config.model_type!r}")
        self.spec: FamilySpec = spec
        self.config = config = text_config(lm.config)  # an image-text model: its language model's
        _, stack = language_stack(lm, spec)
        self.embed = stack.embed_tokens
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        self.vocab_size = lm.lm_head.weight.shape[0]
        self.max_seq_len = max_seq_len
        self.final_norm = _norm(stack.norm)
        self.lm_head = make_group(lm.lm_head)
        self.softcap = logit_softcap(lm.config)
        self.attn_softcap = getattr(config, "attn_logit_softcapping", None)
        self._rope_per_type = hasattr(stack.rotary_emb, "layer_types")  # Gemma 3: local + global RoPE
        attn0 = stack.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.layers = [self._layer(i, layer) for i, layer in enumerate(stack.layers)]
        for g in self.groups:  # NF4 bases: one small-batch kernel launch per group (projections.py)
            g.attach_nf4(self.dtype)
        # Rows from which a step reads every NF4 group through the kernel: one only where each
        # group's measured plan found it faster than bitsandbytes' one-row GEMV.
        self.nf4_min_rows = max((g.nf4.min_rows for g in self.groups if g.nf4 is not None), default=nf4_gemv.MIN_ROWS)
        self.rope = self._rope_tables(stack.rotary_emb)
        self.adapters: list[str] = []
        self.attach_lora()
        self._counter_buf: torch.Tensor | None = None
        self._sums_buf: torch.Tensor | None = None
        self.compile(False)  # eager until compile()

    # --- construction ----------------------------------------------------------------------

    def _layer(self, index: int, layer: nn.Module) -> Layer:
        attn, mlp, cfg = layer.self_attn, layer.mlp, self.config
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        sparse = is_sparse(mlp, self.spec.moe)
        reason = unreadable(mlp, self.spec.moe) if sparse else ""
        if reason:
            raise UnsupportedModelError(f"no decode path for this {self.spec.model_type} model: {reason}")
        return Layer(
            qkv=make_group(attn.q_proj, attn.k_proj, attn.v_proj), o=make_group(attn.o_proj),
            gate_up=None if sparse else make_group(mlp.gate_proj, mlp.up_proj),
            down=None if sparse else make_group(mlp.down_proj),
            act=None if sparse else mlp.act_fn,
            input_norm=_norm(layer.input_layernorm),
            post_attn_norm=_norm(layer.post_attention_layernorm),
            pre_ff_norm=_norm(getattr(layer, "pre_feedforward_layernorm", None)) if self.spec.sandwich_norm else None,
            post_ff_norm=_norm(getattr(layer, "post_feedforward_layernorm", None)) if self.spec.sandwich_norm else None,
            q_norm=_norm(attn.q_norm) if self.spec.qk_norm else None,
            k_norm=_norm(attn.k_norm) if self.spec.qk_norm else None,
            scaling=float(attn.scaling),
            window=int(window) if window else None,
            rope=layer_types[index] if layer_types and self._rope_per_type else "",
            moe=moe_block(mlp, self.spec.moe) if sparse else None,
            sinks=attn.sinks if self.spec.attention_sinks else None,
        )

    @torch.no_grad()
    def _rope_tables(self, rotary: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin (max_seq_len, head_dim) per layer type, from the model's own rotary module."""
        pos = torch.arange(self.max_seq_len, device=self.device)[None]  # (1, S)
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        tables = {}
        for key in sorted({layer.rope for layer in self.layers}):
            cos, sin = rotary(probe, pos, key) if key else rotary(probe, pos)
            cos, sin = cos[0], sin[0]
            if self.spec.rope_half_table:  # (S, d/2): x1 cos - x2 sin | x2 cos + x1 sin is rotate_half's
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # math on repeated halves
            tables[key] = (cos.contiguous(), sin.contiguous())  # (S, d)
        return tables

    @property
    def groups(self) -> list[ProjGroup]:
        """Every projection group: per layer q/k/v, o, gate/up, down; then lm_head."""
        return [g for layer in self.layers for g in layer.groups] + [self.lm_head]

    @property
    def moe_blocks(self) -> list[MoeBlock]:
        return [layer.moe for layer in self.layers if layer.moe is not None]

    def attach_lora(self) -> None:
        """(Re)build the LoRA groups from the PEFT layers now on the model's projections (and the
        experts' parameter wrappers), then fuse."""
        self.unfuse()
        groups = self.groups
        wrappers = [w for block in self.moe_blocks for w in block.wrappers.values()]
        self.adapters = adapter_names([m for g in groups for m in g.modules if is_lora_layer(m)] + wrappers)
        for g in groups:
            g.lora = build_group(g.modules, g.sizes, self.adapters, self.dtype, self.device)
        for block in self.moe_blocks:
            block.attach_lora(self.adapters, self.dtype, self.device)
        self.fuse()

    def sync_lora(self) -> None:
        """Copy the current PEFT adapter weights into the groups (in place: graphs stay valid)."""
        for g in self.groups:
            if g.lora is not None:
                g.lora.sync()
        for block in self.moe_blocks:
            for bank in block.banks:
                bank.sync()

    # --- fused projections (fused.py) --------------------------------------------------------

    @torch.no_grad()
    def fuse(self) -> int:
        """Fuse every layer's groups where allowed; returns how many groups are fused."""
        self._unfused_by_request = False
        if self.fuse_setting is False:
            return 0
        tied = tied_parameters(self.model)
        for layer in self.layers:
            fused = [
                g.fuse(self.dtype, tied)
                for g in layer.groups
                if g.fused is None and fuse_allowed([base_module(m) for m in g.modules], self.model, self.fuse_setting)
            ]
            if any(fused):
                _return_freed_memory(self.device)
        return self.fused_groups

    @property
    def fused_groups(self) -> int:
        return sum(g.fused is not None for g in self.groups)

    def unfuse(self) -> None:
        """Separate products again; the model's projections get their own storage back."""
        self._unfused_by_request = True
        if not self.fused_groups:
            return
        for layer in self.layers:
            for g in layer.groups:
                g.unfuse()
            _return_freed_memory(self.device)

    def refresh(self) -> bool:
        """Before a request: re-fuse after `unfuse()`, re-bind replaced weights. True when the
        groups' layout changed (captured graphs read the old buffers: recapture)."""
        if self._unfused_by_request:
            self.fuse()
            return True
        repaired = [g.repair() for g in self.groups]  # every group, not up to the first failure
        for layer in self.layers:  # experts whose parameters were replaced (e.g. NF4 undone): read anew
            if layer.moe is not None and not layer.moe.current():
                layer.moe = moe_block(layer.moe.module, self.spec.moe)
                layer.moe.attach_lora(self.adapters, self.dtype, self.device)
                repaired.append(False)
        return not all(repaired)

    @property
    def quantized(self) -> bool:
        return any(g.quantized for layer in self.layers for g in layer.groups)

    @property
    def compilable(self) -> bool:
        """True when a step of `nf4_min_rows` to `nf4_gemv.MAX_ROWS` rows calls no quantized module
        (every quantized group reads its NF4 weights through the Triton kernel), so it can be
        compiled; `step` runs other batch sizes of a quantized model eagerly (the modules)."""
        return all(g.nf4 is not None for g in self.groups if g.quantized)

    def new_cache(self, batch: int, length: int) -> StaticKVCache:
        return StaticKVCache(len(self.layers), batch, self.n_kv, length, self.head_dim, self.dtype, self.device)

    # --- math --------------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, norm: Norm, kernel: bool = False) -> torch.Tensor:
        """HF's RMSNorm of the family, op for op; `kernel`: as one `kestrel.kernels.rms_norm` launch (the
        same math; eager prefill only, where each of the eight ops is a launch the host pays)."""
        if kernel:
            gemma = self.spec.norm_casting == "gemma"
            return rms_norm(x, norm.weight, norm.eps, self.spec.norm_offset if gemma else 0.0,
                            "gemma" if gemma else "llama")
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
        if self.spec.norm_casting == "gemma":  # scale in fp32 by (offset + w), then cast
            return (xf * (self.spec.norm_offset + norm.weight.float())).type_as(x)
        return norm.weight * xf.to(x.dtype)  # Llama: cast, then scale

    def _qkv(self, layer: Layer, h: torch.Tensor, pos: torch.Tensor, lora: LoraCall | None, kernels: bool = False):
        """h (B, T, H), pos (B, T) -> q (B, nh, T, d), k and v (B, nkv, T, d), RoPE applied.
        `kestrel.kernels`: QK-norms and RoPE as Triton launches (`_rms`), RoPE in place on the product."""
        b, t, _ = h.shape
        q, k, v = layer.qkv(h, lora)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        v = v.view(b, t, self.n_kv, self.head_dim)
        if layer.q_norm is not None:
            q, k = self._rms(q, layer.q_norm, kernels), self._rms(k, layer.k_norm, kernels)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos_t, sin_t = self.rope[layer.rope]
        if kernels:
            q, k = rope_(q, k, cos_t, sin_t, pos)
            return q, k, v
        cos, sin = cos_t[pos][:, None], sin_t[pos][:, None]  # (B, 1, T, d)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _block(self, layer: Layer, x: torch.Tensor, attn_out: torch.Tensor, lora: LoraCall | None,
               kernels: bool = False) -> torch.Tensor:
        """Everything after attention: o_proj, residuals, norms, MLP. attn_out (B, T, nh*d).
        `kestrel.kernels`: norms as Triton launches (`_rms`)."""
        (a,) = layer.o(attn_out, lora)
        if layer.pre_ff_norm is not None:
            a = self._rms(a, layer.post_attn_norm, kernels)
        x = x + a
        h = self._rms(x, layer.pre_ff_norm if layer.pre_ff_norm is not None else layer.post_attn_norm, kernels)
        if layer.moe is not None:
            h = layer.moe(h, lora)
        else:
            gate, up = layer.gate_up(h, lora)
            (h,) = layer.down(layer.act(gate) * up, lora)
        if layer.post_ff_norm is not None:
            h = self._rms(h, layer.post_ff_norm, kernels)
        return x + h

    def _logits(self, last: torch.Tensor, lora: LoraCall | None) -> torch.Tensor:
        """last (B, 1, H) -> (B, V) float32; the softcap in the model dtype, as HF does."""
        return self._head(self._rms(last, self.final_norm), lora)

    def _softcap_scores(self, scores: torch.Tensor) -> torch.Tensor:
        if self.attn_softcap is None:
            return scores
        return torch.tanh(scores / self.attn_softcap) * self.attn_softcap

    # --- entry points ------------------------------------------------------------------------

    def prefill(
        self, ids: torch.Tensor, pad: torch.Tensor, cache: StaticKVCache, lora: LoraCall | None = None
    ) -> torch.Tensor:
        """ids (B, T) left-padded, pad (B,) -> last-token logits (B, V) float32; fills cache[:, :T]."""
        b, t = ids.shape
        cols = torch.arange(t, device=ids.device)
        pos = (cols[None] - pad[:, None]).clamp_min(0)  # (B, T)
        q_i, k_j = cols[:, None], cols[None]  # (T, 1), (1, T)
        real = k_j[None] >= pad[:, None, None]  # (B, 1, T): pad columns hide
        # A pad query attends to itself only, so its row stays finite.
        base = ((k_j <= q_i) & real) | (k_j == q_i)
        windows = {layer.window for layer in self.layers}
        masks = {w: ((base & (q_i - k_j < w)) | (k_j == q_i)) if w else base for w in windows}
        x = self.embed(ids)  # (B, T, H)
        rep = self.n_heads // self.n_kv
        fast = use_triton(x)  # eager and host-bound: norms and RoPE one launch each on CUDA
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms(x, layer.input_norm, fast), pos, lora, fast)
            cache.write_prefix(i, k, v)
            k = k[:, :, None].expand(b, self.n_kv, rep, t, self.head_dim).reshape(b, self.n_heads, t, self.head_dim)
            v = v[:, :, None].expand(b, self.n_kv, rep, t, self.head_dim).reshape(b, self.n_heads, t, self.head_dim)
            mask = masks[layer.window][:, None]  # (B, 1, T, T)
            if layer.sinks is not None:  # gpt-oss: HF's eager sink softmax
                out = _sink_attention(q, k, v, mask, layer.scaling, layer.sinks)
            elif self.attn_softcap is None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling)
            else:
                scores = self._softcap_scores((q @ k.transpose(-1, -2)) * layer.scaling)
                probs = scores.float().masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
                out = probs @ v
            x = self._block(layer, x, out.transpose(1, 2).reshape(b, t, -1), lora, fast)
        return self._logits(x[:, -1:], lora)

    def step(
        self,
        tok: torch.Tensor,
        col: torch.Tensor,
        pad: torch.Tensor,
        cache: StaticKVCache,
        lora: LoraCall | None = None,
    ) -> torch.Tensor:
        """tok (B,) at cache column col ((1,) long) -> logits (B, V) float32. No host reads.

        Batch 1 on CUDA with at most one adapter runs `fast_layer` (five launches a layer, plus a
        shrink per adapted group) where the family allows. Otherwise each layer is compiled in two parts around the
        attention kernel, not as one graph: every layer of a family has the same shapes, so one
        compiled part serves all of them and compiling takes seconds, not minutes. Each layer
        also computes the NEXT layer's input norm, so the residual add and that norm still fuse
        into one kernel across the layer boundary.
        """
        counters, scratch = self._scratch(tok.shape[0] * self.n_kv)
        if fast_layer.applies(self, tok.shape[0], lora):
            return fast_layer.forward(self, tok, col, pad, cache, counters, scratch, lora)
        x = self.embed(tok[:, None])  # (B, 1, H)
        h = self._rms(x, self.layers[0].input_norm)
        pre_fn, post_fn, head_fn = self._pre_fn, self._post_fn, self._head_fn
        if self.quantized and not self.nf4_min_rows <= tok.shape[0] <= nf4_gemv.MAX_ROWS:
            pre_fn, post_fn, head_fn = self._pre_attention, self._post_attention, self._head  # modules run
        for i, layer in enumerate(self.layers):
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            q = pre_fn(layer, h, col, pad, cache.k[i], cache.v[i], lora)
            out = decode_attention(q, cache.k[i], cache.v[i], col, pad, layer.scaling, layer.window,
                                   self.attn_softcap, counters, layer.sinks)
            x, h = post_fn(layer, after, x, out, lora)
        return head_fn(h, lora)

    def _scratch(self, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 zeros the attention kernel counts on, float32 scratch for `fast_layer`: norm
        sums and adapter partial sums), kept on the model so a captured graph reads the same
        ones on every replay (their sizes are fixed for a model: its adapters are attached
        when it is built)."""
        if self._counter_buf is None or self._counter_buf.numel() < counters:
            self._counter_buf = torch.zeros(max(counters, 64), dtype=torch.int32, device=self.device)
        if self._sums_buf is None:
            self._sums_buf = torch.zeros(fast_layer.scratch_floats(self), dtype=torch.float32, device=self.device)
        return self._counter_buf[:counters], self._sums_buf

    def _pre_attention(
        self,
        layer: Layer,
        h: torch.Tensor,
        col: torch.Tensor,
        pad: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        lora: LoraCall | None,
    ) -> torch.Tensor:
        """h (B, 1, H) the layer's input norm -> q (B, nh, d), RoPE applied; the step's K and V
        go to column `col` of this layer's cache (B, nkv, S, d)."""
        q, k, v = self._qkv(layer, h, (col - pad)[:, None], lora)
        k_cache[:, :, col] = k  # index_put_ with a device index: no host read
        v_cache[:, :, col] = v
        return q[:, :, 0]

    def _post_attention(
        self, layer: Layer, after: Norm, x: torch.Tensor, out: torch.Tensor, lora: LoraCall | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, 1, H) residual stream, out (B, nh, d) attention -> (x', after(x'))."""
        x = self._block(layer, x, out.reshape(x.shape[0], 1, self.n_heads * self.head_dim), lora)
        return x, self._rms(x, after)

    def _head(self, h: torch.Tensor, lora: LoraCall | None) -> torch.Tensor:
        """h (B, 1, H) already normed -> logits (B, V) float32."""
        (logits,) = self.lm_head(h, lora)
        logits = logits[:, 0]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def compile(self, enabled: bool = True) -> None:
        """Compile the per-layer step and the head (for CUDA), or go back to eager."""
        if not enabled:
            self._pre_fn, self._post_fn, self._head_fn = self._pre_attention, self._post_attention, self._head
            return
        self._pre_fn = torch.compile(self._pre_attention, fullgraph=True)
        self._post_fn = torch.compile(self._post_attention, fullgraph=True)
        self._head_fn = torch.compile(self._head, fullgraph=True)


_SINK_SCORES = 1 << 25  # scores a prefill's sink softmax holds at once (128 MB in fp32)


def _sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                    sinks: torch.Tensor) -> torch.Tensor:
    """q, k, v (B, nh, T, d) (KV heads repeated), mask (B, 1, T, T), sinks (nh,) -> (B, nh, T, d):
    `sink_softmax_attention` over chunks of queries, so the scores are (B, nh, C, T) at a time,
    not (B, nh, T, T) (a long prompt's full score tensor would not fit)."""
    b, nh, t, _ = q.shape
    rows = max(1, _SINK_SCORES // (b * nh * t))
    return torch.cat([sink_softmax_attention(q[:, :, i : i + rows], k, v, mask[:, :, i : i + rows], scale, sinks)
                      for i in range(0, t, rows)], dim=2)


def _return_freed_memory(device: torch.device) -> None:
    """Give the blocks freed by (un)fusing back to the driver: the new buffers cannot reuse them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
