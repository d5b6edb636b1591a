"""One generic patcher that puts a loaded Hugging Face model onto Kestrel's fast paths.

The family (`kestrel.model.registry.FamilySpec`, looked up by `config.model_type`) says which module
classes to touch and how; `PatchFlags` says which kernels to use. Patching rebinds `forward` on
the existing module instances (the loaded weights stay where they are) and records every
rebinding in a `PatchHandle`, whose `undo()` restores the original forwards exactly.

Levels patched, as Unsloth does: RMSNorm (layer norms, final norm, QK-norms), attention (QK-norm,
in-place RoPE, fused LoRA QKV, varlen attention for packed rows), MLP (fused GLU, fused LoRA
MLP; a mixture-of-experts block as one grouped expert product, `kestrel.model.moe`), decoder
layer (in-place residuals when no gradient is needed), the decoder stack (rotary
tables and the attention layout once per forward, `kestrel.model.decoder_stack`), the causal-LM head
(loss from hidden states in chunks: the `[tokens, vocab]` logits never exist in training) and
PEFT's LoRA linears (fused LoRA).
Nothing here edits source text; no `exec` or `eval`.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from kestrel.model import forwards as ff
from kestrel.model.fused_lora import lora_linear_forward
from kestrel.model.attention import VarlenMode, varlen_backend
from kestrel.model.decoder_stack import make_model_forward
from kestrel.model.linear_attention import linear_attention_forward, make_segmented_stack_forward
from kestrel.model.moe import make_moe_forward
from kestrel.model.registry import ALL_LEVELS, FamilySpec, family_for, is_image_text, text_config

log = logging.getLogger("kestrel")


@dataclass(frozen=True)
class PatchFlags:
    """Which fast paths to install. All on by default."""

    rms_norm: bool = True
    attention: bool = True  # QK-norm + in-place RoPE (+ fused LoRA QKV when LoRA is attached); linear attention
    mlp: bool = True  # fused GLU (+ fused LoRA MLP when LoRA is attached)
    decoder_layer: bool = True
    model: bool = True  # the decoder stack: rotary + attention layout once per forward
    causal_lm: bool = True  # chunked loss from hidden states
    lora: bool = True  # PEFT LoRA linears through the fused LoRA kernel
    # Packed rows: "auto" runs torch's varlen kernel on CUDA in fp16/bf16 (needs `attention` and
    # `model`), "off" always uses HF's block mask, "reference" a slow SDPA loop (tests, debugging).
    varlen: VarlenMode = "auto"


@dataclass
class PatchHandle:
    """The record of every forward rebound on a model; `undo()` restores them all."""

    family: FamilySpec
    flags: PatchFlags
    _saved: list[tuple[nn.Module, bool, Any]] = field(default_factory=list)

    def rebind(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        had_own = "forward" in module.__dict__
        self._saved.append((module, had_own, module.__dict__.get("forward")))
        module.forward = types.MethodType(forward, module)

    def undo(self) -> None:
        for module, had_own, previous in reversed(self._saved):
            if had_own:
                module.forward = previous
            else:
                del module.forward
        self._saved.clear()

    @property
    def count(self) -> int:
        return len(self._saved)


def _modules_named(model: nn.Module, class_name: str) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == class_name]


def patch_model(model: nn.Module, flags: PatchFlags | None = None) -> PatchHandle | None:
    """Patch `model` in place; returns the handle (also kept as `model.kestrel_patch`).

    An unknown family is left unpatched (it trains through Hugging Face's own path) and a one-line
    notice is logged. Patching twice is a no-op.
    """
    flags = flags or PatchFlags()
    existing = getattr(model, "kestrel_patch", None)
    if existing is not None:
        return existing
    spec = family_for(model.config)
    if spec is None:
        log.warning(
            "Kestrel has no fast path for model type %r; training it through the plain Hugging Face path.",
            getattr(model.config, "model_type", "?"),
        )
        return None
    if not ALL_LEVELS <= spec.levels:
        log.info("Kestrel's fast path covers part of %s (%s); its other modules run Hugging Face's forwards.",
                 spec.model_type, ", ".join(sorted(spec.levels)))
    handle = PatchHandle(spec, flags)
    on = {level for level in spec.levels if getattr(flags, "attention" if level == "linear_attention" else level)}
    if "rms_norm" in on:
        for norm in _modules_named(model, spec.norm_class):
            if getattr(norm, "weight", None) is not None:  # a scale-free norm (Gemma 4's value norm) keeps HF's
                handle.rebind(norm, ff.make_rms_norm_forward(spec))
    if "attention" in on:
        for attn in _modules_named(model, spec.attention_class):
            handle.rebind(attn, ff.make_attention_forward(spec))
    if "linear_attention" in on and spec.linear_attention_class:
        for mixer in _modules_named(model, spec.linear_attention_class):
            handle.rebind(mixer, linear_attention_forward)
        if "model" not in on:  # packed samples' bounds, to those layers (Kestrel's stack hands them itself)
            for stack in _modules_named(model, spec.model_class):
                handle.rebind(stack, make_segmented_stack_forward(stack.forward))
    if "mlp" in on and spec.moe is not None:
        for block in _modules_named(model, spec.moe.block_class):
            handle.rebind(block, make_moe_forward(spec))
    if "mlp" in on and (spec.moe is None or spec.mlp_class != spec.moe.block_class):
        for mlp in _modules_named(model, spec.mlp_class):
            if ff.mlp_activation_matches(mlp, spec):
                handle.rebind(mlp, ff.make_mlp_forward(spec))
            else:
                log.warning("MLP activation %s is not %s; leaving that MLP unpatched.",
                            type(mlp.act_fn).__name__, spec.activation)
    if "decoder_layer" in on:
        for layer in _modules_named(model, spec.decoder_layer_class):
            handle.rebind(layer, ff.make_decoder_layer_forward(spec))
    if "model" in on:
        forward = make_model_forward(spec, flags.varlen if "attention" in on else "off")
        for stack in _modules_named(model, spec.model_class):
            handle.rebind(stack, forward)
    if "causal_lm" in on:
        for head in _modules_named(model, spec.causal_lm_class):
            handle.rebind(head, ff.make_causal_lm_forward(spec, "model" in on))
        if is_image_text(model.config) and isinstance(getattr(model, "lm_head", None), nn.Linear):
            handle.rebind(model, ff.make_image_text_forward(spec, "model" in on))  # text calls: the chunked loss
    model.kestrel_patch = handle
    return handle


def patch_lora_layers(model: nn.Module) -> int:
    """Route PEFT's LoRA linears through the fused LoRA kernel; returns how many were patched.

    Call after attaching LoRA. Layers the fused path cannot run (dropout > 0, a bias, DoRA...)
    keep PEFT's forward at call time, with a one-time notice saying why.
    """
    from peft.tuners.lora import LoraLayer

    handle = _find_handle(model)
    if handle is None or not handle.flags.lora:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and isinstance(module, nn.Module) and hasattr(module, "lora_A"):
            if type(module).__name__ in ("Linear", "Linear4bit"):
                handle.rebind(module, lora_linear_forward)
                count += 1
    return count


def _find_handle(model: nn.Module) -> PatchHandle | None:
    for module in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None), "model", None)):
        handle = getattr(module, "kestrel_patch", None) if module is not None else None
        if handle is not None:
            return handle
    return None


def runs_varlen(model: nn.Module) -> bool:
    """Whether `model`'s training forwards run variable-length attention over the samples of a
    flattened batch (patched attention and decoder stack, and a varlen kernel for its device and
    dtype): then a batch laid out as one padding-free row costs no padding."""
    handle = _find_handle(model)
    if handle is None or not (handle.flags.attention and handle.flags.model):
        return False
    if not {"attention", "model"} <= handle.family.levels:  # HF's stack: its own mask per row
        return False
    embeddings = model.get_input_embeddings().weight
    dropout = getattr(text_config(model.config), "attention_dropout", 0.0) > 0  # an image-text model: its LM's
    sinks = handle.family.attention_sinks
    return varlen_backend(handle.flags.varlen, embeddings.device, embeddings.dtype, dropout, sinks=sinks) is not None


def prompt_sharing_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot score a prompt once for several answers (`kestrel.model.attention.ForkedSamples`:
    each answer's keys are the prompt's and its own, through the varlen kernel), or None when it can."""
    handle = _find_handle(model)
    spec = handle.family if handle is not None else None
    if spec is not None and spec.linear_attention_class:
        return f"{spec.model_type}'s linear-attention layers carry a recurrent state, which would have to fork after the prompt"
    if spec is not None and spec.layer_shared_state:
        return f"{spec.model_type}'s layers share K/V across layers ({spec.layer_shared_state}), which the fork does not follow"
    if spec is not None and spec.attention_sinks:
        return f"{spec.model_type}'s attention sinks have no variable-length attention kernel"
    if spec is not None and spec.attn_softcap_attr and getattr(text_config(model.config), spec.attn_softcap_attr, None):
        return f"{spec.model_type} caps its attention logits ({spec.attn_softcap_attr}), which the varlen kernel does not"
    if not runs_varlen(model):
        return ("no variable-length attention kernel runs this model here (it needs CUDA in fp16/bf16 and Kestrel's "
                "attention and decoder-stack forwards)")
    return None


def packing_refusal(model: nn.Module) -> str | None:
    """Why `model` must not train on packed rows (several samples side by side in one row), or
    None. Attention keeps inside each sample (masks, varlen); a recurrent layer does only on
    Kestrel's linear-attention forward, which the stack tells where each sample starts."""
    spec = family_for(model.config)
    if spec is None or not spec.linear_attention_class:
        return None
    handle = _find_handle(model)
    if handle is None or not handle.flags.attention:
        return (f"{spec.model_type}'s linear-attention layers would carry their state (and short convolution) "
                "from one packed sample into the next without Kestrel's forward for them (fast kernels off)")
    return None


def unpatch_model(model: nn.Module) -> None:
    """Undo every patch on `model` (LoRA-layer patches included)."""
    handle = _find_handle(model)
    if handle is None:
        return
    handle.undo()
    for module in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None), "model", None)):
        if module is not None and "kestrel_patch" in module.__dict__:
            del module.kestrel_patch
