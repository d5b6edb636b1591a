"""Qwen3.5's linear-attention layers (the gated delta rule) on a kernel chosen per call.

Hugging Face binds the implementation once, at import: flash-linear-attention's Triton kernels
whenever the package is installed, its PyTorch reference otherwise. Those kernels need CUDA, so
with the package installed a model on the CPU fails. The forward here picks per call: the
flash-linear-attention chunked kernel (training, prefill) and its recurrent step (decode, one
token) for CUDA tensors, HF's reference functions otherwise. The math is HF's
`Qwen3_5GatedDeltaNet.forward`, step for step:

    qkv = silu(causal_conv1d(x W_qkv))            (B, T, 2*Hk*dk + Hv*dv), per-channel conv of width w
    beta = sigmoid(x W_b),  g = -exp(A_log) * softplus(x W_a + dt_bias)        (B, T, Hv)
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T      (per head, dk x dv)
    o_t = S_t^T q_t (q, k L2-normalised, q scaled by dk^-1/2)
    y = RMSNormGated(o, z = x W_z) W_out

Gradients flow through whichever kernel ran (flash-linear-attention's own backward on CUDA).
Where that backward refuses the device (flash-linear-attention 0.6 raises on Hopper GPUs under
Triton 3.4 to 3.7.0, which miscompile one of its backward stages), a one-time probe per device
finds out and passes that need gradients take `kestrel.kernels.gated_delta`: its kernels with
that one stage done another way (its own kernel on a tile that is not miscompiled, else PyTorch),
the first way that a probe at the layer's head shape shows to give HF's reference's output and
gradients there; else HF's reference functions. Passes without gradients (decode,
prefill, a checkpoint's first pass) keep the kernels. Each choice is logged once. Passes without
a cache take Kestrel's short convolution (`kestrel.kernels.short_conv`) and, on CUDA,
flash-linear-attention's gated norm (`norm_kernel`). Packed rows (several samples in a row) train
each sample as if alone: Kestrel's decoder stack hands these layers each token's offset in its sample
(`segments`), and HF's stack gets them the same way when Kestrel's is off (`make_segmented_stack_forward`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from kestrel.kernels.dispatch import forced_backend
from kestrel.kernels.short_conv import short_conv
from kestrel.model.attention import sample_starts
from kestrel.model.fused_lora import project_together

log = logging.getLogger("kestrel")


@functools.cache
def _fla_ops() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """flash-linear-attention's (chunked, recurrent) gated-delta-rule functions, or None."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


@contextlib.contextmanager
def _apart() -> Iterator[None]:
    """A probe's forward and backward as if run on their own: gradients on and inference mode off
    (a layer's first pass may be an evaluation under no_grad), and its saved tensors kept as they
    are, out of reach of the saved-tensor hooks of a checkpointed or offloaded layer around it
    (which would otherwise count, move or keep them)."""
    with torch.inference_mode(False), torch.enable_grad(), saved_tensors_hooks(lambda x: x, lambda x: x):
        yield


@functools.cache
def fla_backward_works(device: torch.device, chunk: Callable[..., Any]) -> bool:
    """Whether flash-linear-attention's chunked kernel runs its backward on `device`: a probe on
    one tiny chunk, once per device (its refusals are RuntimeErrors naming the fix)."""
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)

    log.info("linear-attention layers on %s: flash-linear-attention compiles and tunes its kernels for each new "
             "layer shape, which takes minutes on a machine that has not run them; Triton's cache keeps them for "
             "later runs", device)
    try:
        with _apart():
            q, k, v = (t(1, 64, 1, 16).requires_grad_() for _ in range(3))
            g, beta = (-t(1, 64, 1).abs()).requires_grad_(), t(1, 64, 1).sigmoid().requires_grad_()
            out, _ = chunk(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
            out.float().sum().backward()
    except RuntimeError as err:
        log.warning("flash-linear-attention cannot train on %s (%s)", device, str(err).splitlines()[0])
        return False
    return True


PROBE_TOLERANCE = 0.05  # relative error of output and gradients: bf16 kernels land near 1%; the
# miscompiled stage's were near 50% (fla issue 984's dk ratio 0.54), so the gap is wide


@functools.cache
def stand_in_way(device: torch.device, heads: int, dk: int, dv: int, dtype: torch.dtype,
                 reference: Callable[..., Any]) -> Callable[..., Any] | None:
    """`kestrel.kernels.gated_delta`'s chunked function with the first of its ways for the refused
    stage (DQKWG, fastest first) that gives `reference`'s (HF's PyTorch function, fp32) output and
    gradients on `device` for a layer of `heads` heads of key width dk and value width dv in
    `dtype`, or None: a probe of two and a half chunks per way. flash-linear-attention tunes its
    launches per head shape, not per length, so the probe runs the settings training will run."""
    from kestrel.kernels import gated_delta

    if not gated_delta.available():
        return None
    for way in gated_delta.DQKWG:
        fn = functools.partial(gated_delta.chunk_gated_delta_rule, dqkwg=way)
        errors = _probe(fn, device, heads, dk, dv, dtype, reference)
        if errors is not None and max(errors) <= PROBE_TOLERANCE:
            log.info("linear-attention layers (%d heads, %d/%d wide) train on flash-linear-attention's kernels on "
                     "%s, with the backward stage it refuses there done the %r way (largest relative error %.3f)",
                     heads, dk, dv, device, way, max(errors))
            return fn
        if errors is not None:
            log.warning("Kestrel's %r way for flash-linear-attention's refused backward stage is off on %s "
                        "(relative errors %s)", way, device,
                        ", ".join(f"{n} {e:.3f}" for n, e in zip(gated_delta.OUTPUTS, errors)))
    log.warning("linear-attention layers train on PyTorch's reference functions on %s, which is slower", device)
    return None


def _probe(fn: Callable[..., Any], device: torch.device, heads: int, dk: int, dv: int, dtype: torch.dtype,
           reference: Callable[..., Any]) -> list[float] | None:
    """Relative errors of `fn`'s output and gradients against `reference`'s on fixed random
    inputs of two and a half chunks, or None where `fn` fails."""
    from kestrel.kernels import gated_delta

    gen = torch.Generator().manual_seed(0)
    t = 5 * gated_delta.CHUNK // 2

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    try:
        with _apart():
            q, k, v, grad = rnd(1, t, heads, dk), rnd(1, t, heads, dk), rnd(1, t, heads, dv), rnd(1, t, heads, dv)
            g, beta = -F.softplus(rnd(1, t, heads)), rnd(1, t, heads).sigmoid()
            got = gated_delta.forward_backward(fn, q, k, v, g, beta, grad, dtype)
            want = gated_delta.forward_backward(reference, q, k, v, g, beta, grad, torch.float32)
    except gated_delta.TileRefused as err:  # by design: narrow heads take the next way
        log.info("Kestrel's %r way is not for this layer on %s (%s)", fn.keywords.get("dqkwg"), device, err)
        return None
    except (RuntimeError, TypeError, ImportError, AttributeError) as err:  # stages that moved or refuse
        log.warning("Kestrel's %r way for flash-linear-attention's refused backward stage failed on %s (%s)",
                    fn.keywords.get("dqkwg") if isinstance(fn, functools.partial) else fn, device, err)
        return None
    return gated_delta.relative_errors(got, want)


def fla_for(on_cuda: bool, device: torch.device, needs_grad: bool) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """flash-linear-attention's functions for a pass on `device`, or None for HF's reference: its
    kernels are CUDA-only, and a pass that needs gradients takes them only where its backward runs."""
    ops = _fla_ops() if on_cuda and forced_backend() != "torch" else None
    if ops is not None and needs_grad and not fla_backward_works(device, ops[0]):
        return None
    return ops


def _reference(module: nn.Module | str, name: str) -> Callable[..., Any]:
    """HF's PyTorch function `name` from the module's modeling file (or the modeling module of
    that name), under any kernel wrapper HF put around it (`functools.wraps` keeps the original
    as `__wrapped__`)."""
    modeling = module if isinstance(module, str) else type(module).__module__
    return inspect.unwrap(getattr(sys.modules[modeling], name))


def delta_rule(
    module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None, keep_state: bool, step: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k (B, T, H, dk); v (B, T, H, dv); g, beta (B, T, H); state (B, H, dk, dv) or None.
    -> output (B, T, H, dv), final state (or None unless `keep_state`). `step`: one token
    after a prefill (the recurrent form), else the chunked form."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
    kwargs = dict(g=g, beta=beta, initial_state=state, output_final_state=keep_state, use_qk_l2norm_in_kernel=True)
    if step:
        fla = fla_for(q.is_cuda, q.device, needs_grad)
        fn = fla[1] if fla is not None else _reference(module, "torch_recurrent_gated_delta_rule")
    else:
        shape = (q.shape[2], q.shape[3], v.shape[3])
        fn = chunked_for(q.is_cuda, q.device, needs_grad, shape, q.dtype,
                         lambda: _reference(module, "torch_chunk_gated_delta_rule"))
    return fn(q, k, v, **kwargs)


def chunked_for(on_cuda: bool, device: torch.device, needs_grad: bool, shape: tuple[int, int, int],
                dtype: torch.dtype, reference: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """The chunked function a pass runs: flash-linear-attention's where it may; where its backward
    is refused, Kestrel's stand-in if it trains right at this head shape (heads, dk, dv) and
    dtype; else HF's function, which `reference()` looks up (only when needed: this runs in every
    layer's forward)."""
    ops = fla_for(on_cuda, device, needs_grad)
    if ops is not None:
        return ops[0]
    ref = reference()
    stand_in = stand_in_way(device, *shape, dtype, ref) if fla_for(on_cuda, device, needs_grad=False) else None
    return stand_in or ref


@functools.cache
def _fla_norm() -> Callable[..., Any] | None:
    """flash-linear-attention's fused gated RMS norm (a Triton kernel with its backward), or None."""
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
    except ImportError:
        return None
    return rms_norm_gated


def norm_kernel(module: nn.Module, x: torch.Tensor, cache: Any) -> Callable[..., Any] | None:
    """flash-linear-attention's gated RMS norm for a pass of `module` over x without a cache
    (training, evaluation): CUDA only, not under KESTREL_KERNELS=torch, and only once a probe at
    the layer's head width and dtype shows it gives Qwen3_5RMSNormGated's output and gradients
    there. It fuses the norm's elementwise steps; passes with a cache keep HF's module."""
    if cache is not None or not x.is_cuda or forced_backend() == "torch" or _fla_norm() is None:
        return None
    return _fla_norm() if norm_kernel_agrees(x.device, module.head_v_dim, x.dtype) else None


@functools.cache
def norm_kernel_agrees(device: torch.device, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether flash-linear-attention's gated norm (head_dim wide) gives Qwen3_5RMSNormGated's
    math's output and input gradients (fp32) on `device` in `dtype`, within PROBE_TOLERANCE: one
    probe of 100 rows."""
    kernel = _fla_norm()

    def norm(o, z, w, fla: bool):  # type: ignore[no-untyped-def]
        if fla:
            return kernel(o, z, w, None, activation="silu", eps=1e-6)
        return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * w * F.silu(z)

    try:
        with _apart():
            errors = _errors(norm, [(100, head_dim)] * 2 + [(head_dim,)], device, dtype)
    except (RuntimeError, TypeError) as err:
        log.warning("linear-attention layers keep HF's gated norm on %s: flash-linear-attention's failed (%s)",
                    device, err)
        return False
    if max(errors) > PROBE_TOLERANCE:
        log.warning("linear-attention layers keep HF's gated norm on %s: flash-linear-attention's is off there "
                    "(largest relative error %.3f)", device, max(errors))
        return False
    return True


def _errors(fn: Callable[..., torch.Tensor], shapes: list[tuple[int, ...]], device: torch.device,
            dtype: torch.dtype) -> list[float]:
    """Relative errors of fn(..., fla=True) in `dtype` against fn(..., fla=False) in fp32: the
    output and each input's gradient of sum(output^2), on the same random inputs of `shapes`."""
    from kestrel.kernels.gated_delta import relative_errors

    runs = []
    for fla, wanted in ((True, dtype), (False, torch.float32)):
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(*s, generator=gen).to(device, wanted).requires_grad_() for s in shapes]
        out = fn(*xs, fla=fla)
        out.float().pow(2).sum().backward()
        runs.append([out.detach().float()] + [x.grad.float() for x in xs])
    return relative_errors(*runs)


# --- packed rows: several samples side by side in one row -----------------------------------

SEGMENTS_KWARG = "kestrel_segment_offsets"  # the keyword the stack hands each linear-attention layer
# The log-gate that empties the state at a sample's first token: exp(-200) is 0 in fp32, and the
# size is that of a layer's own steepest gates (A = exp(A_log) up to 16, times a softplus), so the
# kernels meet nothing new (tests/model/test_linear_attention_packing.py checks them on CUDA).
BOUNDARY_GATE = -200.0


def segment_offsets(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids (B, T) -> (B, T) int64: each token's offset from its sample's first token.
    Samples start where `kestrel.model.attention.sample_starts` says (HF's rule), so a padding
    tail is a sample too."""
    index = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
    first = torch.where(sample_starts(position_ids), index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def make_segmented_stack_forward(inner: Callable[..., Any]) -> Callable[..., Any]:
    """A decoder stack's forward that hands its linear-attention layers each token's offset in
    its sample (`SEGMENTS_KWARG`) when a pass without a cache brings position_ids (packed rows),
    then runs `inner` (the stack's own forward, which passes unknown keywords down to every
    layer). Positions may be (B, T) or, for multimodal rotary embeddings, (k, B, T) whose first
    row is the text's."""

    names = list(inspect.signature(inner).parameters)

    def passed(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        at = names.index(name) if name in names else len(args)
        return args[at] if at < len(args) else kwargs.get(name)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        kwargs.update(segments(passed("position_ids", args, kwargs), passed("past_key_values", args, kwargs)))
        return inner(*args, **kwargs)

    return forward


def segments(position_ids: torch.Tensor | None, past_key_values: Any) -> dict[str, torch.Tensor]:
    """What a stack hands its linear-attention layers for a pass: {SEGMENTS_KWARG: offsets (B, T)} when
    the pass brings position_ids (B, T), or (k, B, T) whose first row is the text's, and no cache; else
    nothing (decoding carries its own states; a row without positions is one sample)."""
    if position_ids is None or past_key_values is not None:
        return {}
    return {SEGMENTS_KWARG: segment_offsets(position_ids if position_ids.ndim == 2 else position_ids[0])}


def linear_mixer(layer: nn.Module, spec: Any) -> nn.Module | None:
    """A decoder layer's linear-attention token mixer (`FamilySpec.linear_attention_class`, held at
    `linear_attention_attr` in place of attention), or None for an attention layer."""
    if spec.linear_attention_class is None:
        return None
    mixer = getattr(layer, spec.linear_attention_attr, None)
    return mixer if type(mixer).__name__ == spec.linear_attention_class else None


def _mix(self: nn.Module, mixed: torch.Tensor, cache: Any, cached: bool,
         offsets: torch.Tensor | None = None) -> torch.Tensor:
    """The short causal convolution over the concatenated q/k/v channels, (B, T, C) -> (B, T, C).
    Passes without a cache (training, evaluation) take Kestrel's (`kestrel.kernels.short_conv`:
    Triton on CUDA, reading and writing (B, T, C) as it is, each packed sample on its own where
    `offsets` marks them); passes with one keep HF's functions, which read and update the cache's
    convolution state."""
    weight = self.conv1d.weight.squeeze(1)  # (C, w)
    if cache is None:
        return short_conv(mixed, weight, self.conv1d.bias, self.activation, offsets)
    return _hf_mix(self, mixed.transpose(1, 2), weight, cache, cached).transpose(1, 2)


def _hf_mix(self: nn.Module, mixed: torch.Tensor, weight: torch.Tensor, cache: Any, cached: bool) -> torch.Tensor:
    """`_mix` on HF's functions, in their layout: (B, C, T) -> (B, C, T)."""
    seq_len = mixed.shape[-1]
    if cached and seq_len == 1 and not cache.layers[self.layer_idx].record_past:
        state = cache.layers[self.layer_idx].conv_states[0]
        return _reference(self, "causal_conv1d_update")(mixed, state, weight, self.conv1d.bias, self.activation)
    if cache is not None:
        mixed = cache.update_conv_state(mixed, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
    out = _reference(self, "causal_conv1d_fn")(mixed, weight, self.conv1d.bias, activation=self.activation)
    return out[:, :, -seq_len:] if cache is not None else out


def linear_attention_forward(
    self: nn.Module, hidden_states: torch.Tensor, cache_params: Any = None,
    attention_mask: torch.Tensor | None = None, **kwargs: Any,
) -> torch.Tensor:
    """Qwen3_5GatedDeltaNet's forward (see the module docstring). hidden_states (B, T, hidden);
    attention_mask (B, T) or None: padding positions are zeroed before the convolution, so a
    left-padded row's state stays zero until its first token. kwargs[SEGMENTS_KWARG] (B, T),
    each token's offset in its sample (packed rows, no cache): the convolution sees only its own
    sample, and the gate at each sample's first token is BOUNDARY_GATE, so the state it starts
    from is exp(BOUNDARY_GATE) S = 0, as for a sample alone (whose first gate has no effect)."""
    offsets = kwargs.pop(SEGMENTS_KWARG, None)
    offsets = offsets if cache_params is None else None  # decoding carries its own states
    if attention_mask is not None:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    b, t, _ = hidden_states.shape
    cached = cache_params is not None and cache_params.has_previous_state(self.layer_idx, state_idx=0)
    # One Function for the two adapted projections of this input: one dX, not an autograd add
    mixed, z = project_together(hidden_states, self.in_proj_qkv, self.in_proj_z)
    mixed = _mix(self, mixed, cache_params, cached, offsets)
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q, k = q.reshape(b, t, -1, self.head_k_dim), k.reshape(b, t, -1, self.head_k_dim)
    v = v.reshape(b, t, -1, self.head_v_dim)
    z = z.reshape(-1, self.head_v_dim)  # (B*T*Hv, dv), the output gate
    beta = self.in_proj_b(hidden_states).sigmoid()  # (B, T, Hv)
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)  # fp32: A may overflow fp16
    if offsets is not None:  # a packed sample starts from an empty state
        g = g.masked_fill((offsets == 0).unsqueeze(-1), BOUNDARY_GATE)
    if self.num_v_heads > self.num_k_heads:  # grouped values: each q/k head serves num_v // num_k value heads
        rep = self.num_v_heads // self.num_k_heads
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    state = cache_params.layers[self.layer_idx].recurrent_states[0] if cached else None
    out, final = delta_rule(self, q, k, v, g, beta, state, cache_params is not None, step=cached and t == 1)
    if cache_params is not None:
        cache_params.update_recurrent_state(final, self.layer_idx)
    norm = norm_kernel(self, out, cache_params)
    if norm is not None:  # the gated RMS norm, norm(o) * weight * silu(z), in one kernel
        out = norm(out.reshape(-1, self.head_v_dim), z, self.norm.weight, None, activation="silu",
                   eps=self.norm.variance_epsilon)
    else:
        out = self.norm(out.reshape(-1, self.head_v_dim), z)
    out = out.reshape(b, t, -1)
    return self.out_proj(out)
