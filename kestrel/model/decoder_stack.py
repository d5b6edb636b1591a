"""The decoder stack's forward (`FamilySpec.model_class`: LlamaModel ... Gemma3TextModel).

Rebound by `kestrel.model.patching` for the training / no-cache path, as Unsloth patches the model
level: embeddings, position ids, rotary tables and the attention layout are computed once per
forward, then every decoder layer is called through its `__call__` (so Hugging Face gradient
checkpointing, which `kestrel.recompute.checkpoint` hooks into, keeps working), then the final norm.

The attention layout (`kestrel.model.attention`) is where this differs from HF: packed and padded rows
on CUDA in 16-bit run the varlen kernel instead of a (B, 1, T, T) mask. Everything else uses the very
masks HF builds. A caller may also hand it `ForkedSamples` (keyword `attn.FORK_KWARG`): groups that
share a prefix, every layer then attends through the varlen kernel with keys of their own (no
host sync at all: the caller built the layout); or the batch's sample starts read from its host copy
(`attn.HostStarts`, keyword `attn.STARTS_KWARG`), which spares the forward its one host sync.
A family's linear-attention layers (Qwen3.5) get the padding mask and each token's offset in its sample
instead of an attention layout.
Any other call this forward does not handle (a cache, `use_cache`, attention or hidden-state
outputs, a prepared 4-D mask, unknown keywords...) goes to the original class forward unchanged.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from kestrel.model import attention as attn
from kestrel.model import linear_attention as linear
from kestrel.model import moe
from kestrel.model.registry import FamilySpec

# Keywords HF hands down to the layers, which change nothing in the math.
_PASSTHROUGH = frozenset({"num_items_in_batch"})
# Keywords read here to decide whether to delegate, and not passed on.
_CHECKED = frozenset({"output_attentions", "output_hidden_states", "return_dict", attn.FORK_KWARG})

LayerInputs = tuple[Any, attn.VarlenCall | None]  # (HF attention mask or None, varlen call or None)


def _use_cache(model: nn.Module, use_cache: bool | None) -> bool:
    # As HF's merge_with_config_defaults: the config decides when the caller did not, and
    # gradient checkpointing in training turns the cache off.
    value = use_cache if use_cache is not None else getattr(model.config, "use_cache", False)
    return bool(value) and not (getattr(model, "gradient_checkpointing", False) and model.training)


def handles(
    model: nn.Module, spec: FamilySpec, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
    attention_mask: Any, past_key_values: Any, use_cache: bool | None, kwargs: dict[str, Any],
    position_ids: torch.Tensor | None = None,
) -> bool:
    """True when this forward computes the call exactly; False sends it to HF's own forward."""
    config = model.config
    if (input_ids is None) == (inputs_embeds is None):  # HF raises its own error
        return False
    if position_ids is not None and position_ids.dim() != 2:  # an image-text model's per-axis positions
        return False
    if past_key_values is not None or _use_cache(model, use_cache):
        return False
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
        return False  # a prepared 4-D mask, a per-layer-type dict, a BlockMask
    if set(kwargs) - _PASSTHROUGH - _CHECKED:
        return False
    for name in ("output_attentions", "output_hidden_states"):
        if kwargs.get(name, getattr(config, name, False)):
            return False
    if kwargs.get("return_dict", getattr(config, "return_dict", True)) is False:
        return False
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        return False
    # HF 5.17's Gemma 3 ignores this cap; whatever HF does with it, it is HF's to do.
    return not (spec.attn_softcap_attr and getattr(config, spec.attn_softcap_attr, None))


def _hf_mask(model: nn.Module, window: int | None, embeds: torch.Tensor, attention_mask: Any, position_ids: Any) -> Any:
    """The mask HF's own forward builds for layers of this window, with HF's own helpers."""
    module = sys.modules[type(model).__module__]
    build = module.create_causal_mask if window is None else module.create_sliding_window_causal_mask
    return build(
        config=model.config, inputs_embeds=embeds, attention_mask=attention_mask,
        past_key_values=None, position_ids=position_ids,
    )


def attention_inputs(
    model: nn.Module, mode: attn.VarlenMode, windows: list[int | None], embeds: torch.Tensor,
    attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, *, sinks: bool = False,
    forked: attn.ForkedSamples | None = None, host: attn.HostStarts | None = None,
) -> dict[int | None, LayerInputs]:
    """The attention layout of one forward: for each window size in `windows`, what its layers get.

    embeds (B, T, H); attention_mask (B, T) or None; position_ids (B or 1, T) as the caller gave
    them, None when defaulted (then there is nothing to detect); sinks: the family's attention
    has sinks (`FamilySpec.attention_sinks`). At most one host sync: the sample starts, when the
    varlen path could run, the caller passed positions and not `host`. `forked`: the caller's layout of
    groups sharing a prefix, which only the varlen kernel runs (a sliding window stays exact:
    flash aligns it bottom-right, at each query's own position). `host`: the sample starts the caller
    read from its host copy of the batch (then there is no sync at all).
    """
    b, t = embeds.shape[:2]
    dropout = model.training and getattr(model.config, "attention_dropout", 0.0) > 0
    fn = attn.varlen_backend(mode, embeds.device, embeds.dtype, dropout, sinks=sinks)
    if forked is not None:
        if fn is None or attention_mask is not None or b != 1:
            raise ValueError("forked samples (a shared prompt) need one padding-free row and a varlen kernel for this "
                             f"device and dtype ({embeds.device.type}, {embeds.dtype}, varlen {mode!r}, dropout "
                             f"{dropout}); score the answers as separate sequences instead")
        return {w: (None, attn.VarlenCall(forked.queries, attn.flash_window(w), fn, forked.keys))
                for w in dict.fromkeys(windows)}
    padded, packed, samples, hf_positions = attention_mask is not None, False, None, position_ids
    starts = None if fn is None else _starts(host, attention_mask, position_ids, b, t)
    if starts is not None:
        packed = bool(starts[:, 1:].any())  # samples or runs of padding inside the rows
        padded = False  # padding, if any, is a segment of its own now
        if packed:
            samples = attn.samples_from_starts(starts, embeds.device)
        elif position_ids is not None:
            hf_positions = None  # HF would find no packing either; spares its own sync
    out: dict[int | None, LayerInputs] = {}
    for window in dict.fromkeys(windows):
        plan = attn.plan_layer(padded=padded, packed=packed, window=window, seq_len=t, varlen=fn is not None, sinks=sinks)
        if plan == "hf_mask":
            out[window] = (_hf_mask(model, window, embeds, attention_mask, hf_positions), None)
        else:
            rows = samples if plan == "varlen_samples" else attn.row_samples(b, t, embeds.device)
            out[window] = (None, attn.VarlenCall(rows, attn.flash_window(window), fn))
    return out


def _starts(host: attn.HostStarts | None, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
            b: int, t: int) -> torch.Tensor | None:
    """The batch's (B, T) sample starts on the host: the caller's, else read from the device (the one sync)."""
    if host is None:
        return attn.segment_starts(attention_mask, position_ids, b)
    if host.starts is not None and tuple(host.starts.shape) != (b, t):
        raise ValueError(f"{attn.STARTS_KWARG}: sample starts of shape {tuple(host.starts.shape)} for a batch of "
                         f"{b} x {t} tokens; compute them from this batch's own host tensors (attn.host_starts)")
    return host.starts


def _rotary(model: nn.Module, spec: FamilySpec, h: torch.Tensor, position_ids: torch.Tensor) -> list[Any]:
    """(cos, sin) for each layer, each (B or 1, T, D), computed once per table."""
    layers = range(model.config.num_hidden_layers)
    if spec.mrope:  # text: the same positions on each axis, as HF's stack lays them out for text
        position_ids = position_ids[None].expand(3, *position_ids.shape)
    if not spec.rope_per_layer_type:
        table = model.rotary_emb(h, position_ids)
        return [table for _ in layers]
    # Gemma 3: one table per layer type (local rope_theta for sliding layers, global for full ones).
    types = model.config.layer_types
    tables = {kind: model.rotary_emb(h, position_ids, kind) for kind in dict.fromkeys(types)}
    return [tables[types[i]] for i in layers]


def _layer_inputs(
    model: nn.Module, spec: FamilySpec, layers: Any, mode: attn.VarlenMode, embeds: torch.Tensor,
    attention_mask: torch.Tensor | None, given_positions: torch.Tensor | None,
    forked: attn.ForkedSamples | None, host: attn.HostStarts | None,
) -> list[tuple[Any, dict[str, Any]]]:
    """Each layer's (attention_mask, extra keywords) for one forward. Attention layers: the layout of
    their window (`attention_inputs`: HF's mask, or a varlen call). Linear-attention layers (Qwen3.5):
    the (B, T) padding mask as given (zeroing padded inputs) and, with position_ids, each token's offset
    in its sample (`linear_attention.segments`), so a packed sample starts from an empty state."""
    recurrent = [linear.linear_mixer(layer, spec) is not None for layer in layers]
    windows = [attn.layer_window(spec, model.config, i) for i in range(len(layers))]
    layouts = {}
    if not all(recurrent):
        layouts = attention_inputs(model, mode, [w for w, r in zip(windows, recurrent) if not r], embeds,
                                   attention_mask, given_positions, sinks=spec.attention_sinks, forked=forked, host=host)
    segments = linear.segments(given_positions, None) if any(recurrent) else {}
    out: list[tuple[Any, dict[str, Any]]] = []
    for window, is_recurrent in zip(windows, recurrent):
        if is_recurrent:
            out.append((attention_mask, dict(segments)))
            continue
        mask, varlen = layouts[window]
        out.append((mask, {attn.VARLEN_KWARG: varlen} if varlen is not None else {}))
    return out


def make_model_forward(spec: FamilySpec, mode: attn.VarlenMode = "auto") -> Callable[..., BaseModelOutputWithPast]:
    """The decoder stack's forward; `mode` is the varlen choice ("off" when attention is unpatched)."""

    def forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        forked, host = kwargs.get(attn.FORK_KWARG), kwargs.pop(attn.STARTS_KWARG, None)  # starts: never on to HF
        given = kwargs.pop(moe.ROUTER_STATS_KWARG, None)  # the head's, which then reads them itself
        if not handles(self, spec, input_ids, inputs_embeds, attention_mask, past_key_values, use_cache, kwargs,
                       position_ids):
            if forked is not None:  # HF's forward has no such layout: it would score something else
                raise ValueError(f"{spec.model_type}: this call goes to Hugging Face's forward, which cannot run "
                                 "forked samples (a shared prompt); score the answers as separate sequences")
            if spec.linear_attention_class:  # packed samples' bounds, to its linear-attention layers
                kwargs.update(linear.segments(position_ids, past_key_values))
            return type(self).forward(
                self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
            )
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, H); Gemma scales inside
        given_positions = position_ids
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, T)
        layers = self.layers[: self.config.num_hidden_layers]
        inputs = _layer_inputs(self, spec, layers, mode, h, attention_mask, given_positions, forked, host)
        rotary = _rotary(self, spec, h, position_ids)
        passed = {k: v for k, v in kwargs.items() if k in _PASSTHROUGH}
        stats = given if given is not None else moe.router_stats_for(self.config, spec, attention_mask)
        for i, layer in enumerate(layers):
            mask, extra = inputs[i]
            if stats is not None and "forward" in layer.__dict__:  # a patched layer hands it to its block
                extra[moe.ROUTER_STATS_KWARG] = stats
            # hidden states go positionally: HF's checkpointing hands only *args to the checkpoint function.
            h = layer(
                h, attention_mask=mask, position_embeddings=rotary[i], position_ids=position_ids, **passed, **extra
            )
        if stats is not None and given is None:  # a caller of the stack alone gets the sums with the output
            return moe.MoeStackOutput(last_hidden_state=self.norm(h), past_key_values=None, router_stats=stats)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), past_key_values=None)

    return forward
