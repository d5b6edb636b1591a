"""The forwards that `kestrel.model.patching` binds onto a family's modules.

Each `make_*_forward(spec)` returns a plain function `forward(self, ...)` with the signature of
the Hugging Face forward it replaces, computing the same math through `kestrel.kernels` (Triton on CUDA,
the PyTorch references elsewhere, chosen by `kestrel.kernels.dispatch`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kestrel import kernels
from kestrel.recompute import checkpoint as checkpointing
from kestrel.model.attention import VARLEN_KWARG, layer_window, varlen_attention
from kestrel.model.kept_attention import KEPT_KWARG, stored_causal_attention, stored_projection, stored_qkv
from kestrel.model.fused_lora import fused_lora_weights
from kestrel.model.linear_attention import SEGMENTS_KWARG, linear_mixer
from kestrel.model.moe import ROUTER_STATS_KWARG, RouterStats, router_stats_for, router_stats_from_logits
from kestrel.model.multimodal import media_inputs
from kestrel.model.registry import FamilySpec, logit_softcap, text_config

# --- RMSNorm ---------------------------------------------------------------------------------


def make_rms_norm_forward(spec: FamilySpec) -> Callable[..., torch.Tensor]:
    offset, casting = spec.norm_offset, spec.norm_casting

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        return kernels.rms_norm(x, self.weight, eps, offset=offset, casting=casting)

    return forward


# --- Attention -------------------------------------------------------------------------------


def _rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place RoPE on q, k (B, h, T, d); with partial rotary (cos, sin (B, T, r), r < d: Qwen3.5's
    quarter of head_dim) only the first r channels turn, as HF's `apply_rotary_pos_emb` does."""
    rot = cos.shape[-1]
    if rot == q.shape[-1]:
        return kernels.rope_(q, k, cos, sin)
    q_rot, k_rot = kernels.rope_(q[..., :rot], k[..., :rot], cos, sin)
    return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)


def _admits_qkv(store: Any, hidden_states: torch.Tensor) -> bool:
    """Whether a first pass keeps its Q, K and V (`keep_qkv`): only where its attention output will be kept,
    so the store is asked before the projections run (rows (B, T, hidden))."""
    if store is None or not store.keeps_qkv or torch.is_grad_enabled() or hidden_states.dim() != 3:
        return False
    batch, seq, hidden = hidden_states.shape
    return store.admits(seq, batch * seq, hidden, hidden_states.device)


def _hf_attention(module: nn.Module, spec: FamilySpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attention_mask: Any, window: int | None, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """HF's attention function for the model's `_attn_implementation` (its eager one by default) on
    q (B, h, T, d) and k, v (B, kv, S, d): (output (B, T, h, d), weights or None)."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager)
    if window is not None:  # flash / flex read the window from here (Mistral's included)
        kwargs["sliding_window"] = window
    if spec.attention_sinks:  # gpt-oss off the varlen path: HF's eager, flash and flex kernels take them as s_aux
        kwargs["s_aux"] = module.sinks
    return interface(module, q, k, v, attention_mask, dropout=module.attention_dropout if module.training else 0.0,
                     scaling=module.scaling, **kwargs)


def make_attention_forward(spec: FamilySpec) -> Callable[..., tuple[torch.Tensor, Any]]:
    """Attention with QK-norm, in-place RoPE and fused LoRA QKV; varlen when the model forward says so.

    With `spec.attn_output_gate` (Qwen3.5) q_proj yields 2*d per head, (query, gate), and the
    attention output (B, T, h*d) is multiplied by sigmoid(gate) before o_proj.
    """

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        window = layer_window(spec, self.config, self.layer_idx)
        varlen = kwargs.pop(VARLEN_KWARG, None)  # set by the model forward, once per forward
        plain = (varlen is None and attention_mask is None and past_key_values is None and window is None
                 and not spec.attention_sinks and not (self.training and self.attention_dropout))
        store = kwargs.pop(KEPT_KWARG, None)  # a checkpoint keeping this layer's attention output
        store = store if plain else None  # keeping serves plain causal rows alone
        q, k, v = stored_qkv(hidden_states, (self.q_proj, self.k_proj, self.v_proj), store, _admits_qkv(store, hidden_states))
        gate = None
        if spec.attn_output_gate:
            q, gate = torch.chunk(q.view(*input_shape, -1, 2 * self.head_dim), 2, dim=-1)
            gate = gate.reshape(*input_shape, -1)  # (B, T, h*d)
        q, k, v = q.reshape(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)  # (B, T, h, d)
        if spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, h, T, d)
        cos, sin = position_embeddings
        if spec.rope_half_table and 2 * cos.shape[-1] == q.shape[-1]:  # gpt-oss: halves rotate as rotate_half's
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # (not Qwen3.5's partial RoPE)
        q, k = _rope_(q, k, cos, sin)
        kwargs.pop(SEGMENTS_KWARG, None)  # for the linear-attention layers; masks keep attention in its sample
        if varlen is not None:
            out = varlen_attention(q, k, v, varlen, self.scaling, self.sinks if spec.attention_sinks else None)
            return self.o_proj(out if gate is None else out * torch.sigmoid(gate)), None
        if store is not None:
            out = stored_causal_attention(q, k, v, self.scaling, store, hidden_states.shape[-1])  # plain causal rows
            if out is not None:
                out = out.transpose(1, 2).reshape(*input_shape, -1)
                return stored_projection(self.o_proj, out if gate is None else out * torch.sigmoid(gate), store), None
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        out, weights = _hf_attention(self, spec, q, k, v, attention_mask, window, kwargs)
        out = out.reshape(*input_shape, -1).contiguous()
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out), weights

    forward.takes_kept_attention = True  # type: ignore[attr-defined]
    return forward


# --- MLP -------------------------------------------------------------------------------------


def mlp_activation_matches(mlp: nn.Module, spec: FamilySpec) -> bool:
    """True when the module's activation is the one the family's fused GLU computes."""
    act = getattr(mlp, "act_fn", None)
    name = type(act).__name__.lower()
    if spec.activation == "swiglu":
        return isinstance(act, nn.SiLU) or "silu" in name
    return "tanh" in name and "gelu" in name


def make_mlp_forward(spec: FamilySpec) -> Callable[..., torch.Tensor]:
    glu = kernels.swiglu if spec.activation == "swiglu" else kernels.geglu

    def forward(
        self: nn.Module, x: torch.Tensor, discard_output: bool = False, gate_store: Any = None, defer: Any = None,
    ) -> torch.Tensor:
        """discard_output: the caller uses only the output's graph, not its values (see
        `kestrel.kernels.lora_mlp`); gate_store: where an offloaded checkpoint keeps the gate product
        (`kestrel.kernels.lora.mlp.GateStore`); defer: whether a recompute defers to its backward
        (`kestrel.kernels.lora.mlp.DeferPolicy`). All honoured by the fused LoRA path, ignored by the others."""
        fused = [fused_lora_weights(getattr(self, n)) for n in ("gate_proj", "up_proj", "down_proj")]
        if all(w is not None and w.bias is None for w in fused):  # biased: each projection fused on its own
            return kernels.lora_mlp(
                x, *fused, activation=spec.activation, discard_output=discard_output,
                gate_store=gate_store, defer=defer,
            )
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x)))

    forward.takes_layer_args = True  # type: ignore[attr-defined]
    return forward


def _mlp_args(layer: nn.Module, spec: FamilySpec, scope: checkpointing.Recompute | None) -> dict[str, Any] | None:
    """What the layer's checkpoint tells a patched MLP (its gate-product store), or None for an
    unpatched MLP; `discard_output` when the MLP may skip computing its output: in a
    checkpoint's recompute the layer's output values are thrown away, and when the MLP's output
    goes straight into the residual sum (no post-MLP norm, whose backward would need them) only
    its gradient path matters. `scope`: the layer's checkpointing (`checkpointing.scope_of`)."""
    if not getattr(layer.mlp.forward, "takes_layer_args", False):
        return None
    if scope is None:
        return {}
    return {"gate_store": scope.gate, "discard_output": scope.recomputing and not spec.sandwich_norm,
            "defer": scope.deferral}


class _GraphOnlySum(torch.autograd.Function):
    """residual + update where the sum's values are thrown away (a recompute's layer output):
    the add's graph, so dOut reaches both operands unchanged, without the add (or its 3 passes
    over a (tokens, hidden) tensor). The output is `update` itself (its values unspecified): no
    new memory (a discarded MLP output is a broadcast element, `kestrel.kernels.lora.mlp`)."""

    @staticmethod
    def forward(ctx: Any, residual: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        return update

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad


# --- Decoder layer ---------------------------------------------------------------------------


def _moe_mlp(layer: nn.Module, h: torch.Tensor, router_stats: Any) -> torch.Tensor:
    """The layer's sparse block on h; its router's sums go to `router_stats` in the forward
    that builds the loss, not again in a checkpoint's recompute."""
    scope = checkpointing.scope_of(layer)
    if getattr(layer.mlp.forward, "takes_router_stats", False):
        out = layer.mlp(h, router_stats=None if scope is not None and scope.recomputing else router_stats)
    else:
        out = layer.mlp(h)
    return out[0] if isinstance(out, tuple) else out  # gpt-oss's block also returns its router scores


def _residual_add(residual: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """residual + update, written into `update` (a sublayer's fresh output) where that is safe:
    one (tokens, hidden) tensor less at a layer's end, which at long contexts (3 GiB at 400K
    tokens) is what decides whether the recomputed layer fits. An add's backward needs neither
    operand, and autograd raises, rather than computing wrong gradients, should a Function have
    saved `update` itself. Out of place when `update` is a leaf or a view, or the sum would
    change dtype or shape; without autograd (a checkpoint's first pass, decode, rollouts) a view
    is written too."""
    recorded = torch.is_grad_enabled() and (residual.requires_grad or update.requires_grad)
    fresh = not recorded or (not update.is_leaf and update._base is None)
    if fresh and update.shape == residual.shape and update.dtype == residual.dtype:
        return update.add_(residual)
    return residual + update


def make_decoder_layer_forward(spec: FamilySpec) -> Callable[..., torch.Tensor]:
    """A decoder layer: norm, token mixer (attention, or a family's linear attention), residual,
    norm, MLP (dense, or a sparse block), residual; Gemma's sandwich norms around each sublayer.
    The residual sums are written in place where safe (`_residual_add`), and a checkpoint's
    recompute skips what its thrown-away output needs (`_mlp_args`)."""
    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        router_stats = kwargs.pop(ROUTER_STATS_KWARG, None)
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
        scope = checkpointing.scope_of(self)
        mixer = linear_mixer(self, spec)
        if mixer is not None:  # a recurrent layer (Qwen3.5): its mask is the 2-D padding mask or None
            h = mixer(hidden_states=h, cache_params=past_key_values, attention_mask=attention_mask, **kwargs)
        else:
            store = scope.attention if scope is not None else None
            if store is not None and getattr(self.self_attn.forward, "takes_kept_attention", False):
                kwargs[KEPT_KWARG] = store
            h, _ = self.self_attn(
                hidden_states=h,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        if spec.sandwich_norm:
            h = self.post_attention_layernorm(h)
        h = _residual_add(residual, h)
        residual = h
        h = self.pre_feedforward_layernorm(h) if spec.sandwich_norm else self.post_attention_layernorm(h)
        if spec.moe is not None and type(self.mlp).__name__ == spec.moe.block_class:
            return _residual_add(residual, _moe_mlp(self, h, router_stats))
        args = _mlp_args(self, spec, scope)
        if args and args["discard_output"]:  # a recompute: only the graph of the MLP and the last sum is used
            return _GraphOnlySum.apply(residual, self.mlp(h, **args))
        h = self.mlp(h, **args) if args else self.mlp(h)
        if spec.sandwich_norm:
            h = self.post_feedforward_layernorm(h)
        return _residual_add(residual, h)

    return forward


# --- Causal-LM head: chunked loss from hidden states -----------------------------------------


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """(B, T) labels -> (B, T) targets where position t predicts token t+1; the last is ignored."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def make_causal_lm_forward(spec: FamilySpec, kestrel_stack: bool) -> Callable[..., CausalLMOutputWithPast]:
    """The head: the stack's hidden states (B, T, H), then with labels (or shift_labels) the chunked
    loss (`kernels.fused_linear_cross_entropy`: no (B*T, V) logits held), else the logits kept. Also
    serves an image-text model's text calls (`make_image_text_forward`): its `model` runs the language
    model, and the language model's config (`text_config`) holds the cap and the routers' sizes.
    `kestrel_stack`: whether the decoder stack runs Kestrel's forward (patched at the `model` level), which
    sums a MoE's routers into the stats the head hands it; else HF's stack records their logits."""

    def forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        config = text_config(self.config)
        num_items = kwargs.pop("num_items_in_batch", None)
        targets = kwargs.pop("shift_labels", None)
        add_aux = kwargs.pop("output_router_logits", None)
        add_aux = getattr(config, "output_router_logits", False) if add_aux is None else add_aux
        stats = None
        if spec.moe is not None and kestrel_stack:  # Kestrel's stack sums the routers into the head's stats
            stats = kwargs[ROUTER_STATS_KWARG] = router_stats_for(config, spec, attention_mask)
        elif spec.moe is not None and (add_aux or labels is not None or targets is not None):
            kwargs["output_router_logits"] = True  # HF's stack records the routers' logits for the aux loss
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
        )
        hidden = outputs.last_hidden_state  # (B, T, H)
        softcap = logit_softcap(self.config)
        loss, logits = None, None
        if labels is not None or targets is not None:
            targets = shift_labels(labels) if targets is None else targets
            reduction = "sum" if num_items is not None else "mean"
            loss = kernels.fused_linear_cross_entropy(
                hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, targets.reshape(-1),
                softcap=softcap, reduction=reduction,
            )
            if num_items is not None:
                loss = loss / num_items
        else:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden[:, keep, :])
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
        if spec.moe is None:
            return CausalLMOutputWithPast(
                loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            )
        return _moe_output(spec, config, outputs, attention_mask, loss, logits, add_aux, stats)

    return forward


def _moe_output(spec: FamilySpec, config: Any, outputs: Any, attention_mask: torch.Tensor | None,
                loss: torch.Tensor | None, logits: torch.Tensor | None, add_aux: bool,
                stats: RouterStats | None) -> MoeCausalLMOutputWithPast:
    """A MoE head's output: the routers' load-balancing term from the sums Kestrel's stack added to `stats`
    or from the logits HF's stack recorded, added to the loss (scaled by `router_aux_loss_coef`) where
    `add_aux` asks, as HF does."""
    if stats is None or stats.empty:
        stats = getattr(outputs, "router_stats", None) or router_stats_from_logits(
            config, spec, attention_mask, getattr(outputs, "router_logits", None))
    aux = stats.loss() if stats is not None else None
    if aux is not None and loss is not None and add_aux:
        loss = loss + config.router_aux_loss_coef * aux.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits, past_key_values=outputs.past_key_values,
                                     hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def make_image_text_forward(spec: FamilySpec, kestrel_stack: bool) -> Callable[..., Any]:
    """An image-text model's forward (`...ForConditionalGeneration`: its `model` holds the vision tower
    and the language model, its `lm_head` the head): a call with text alone takes the causal-LM head
    above (the chunked loss, not HF's (B, T, V) logits and their fp32 copy in its loss); a call
    carrying images, video or audio (`media_inputs`), or positional arguments, goes to HF's own forward."""
    text = make_causal_lm_forward(spec, kestrel_stack)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args or media_inputs(kwargs):
            return type(self).forward(self, *args, **kwargs)
        return text(self, **kwargs)

    return forward
