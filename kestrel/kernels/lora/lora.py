"""Fused LoRA projections with hand-written backward passes, over 16-bit or NF4 base weights.

One projection with a frozen base `W (out, in)` and an adapter `A (r, in)`, `B (out, r)`,
scaling `s`, on `X (M, in)` (all leading dims flattened into M):

    Y = X W^T + s (X A^T) B^T                                   (M, out)

Backward, given dY (M, out), computed rank-first so no (out, in) weight gradient ever forms:

    dYB = s dY B                                                (M, r)
    dA  = dYB^T X              = s (dY B)^T X                   (r, in)
    dB  = dY^T (s X A^T)       = s dY^T (X A^T)                 (out, r)
    dX  = dY W + dYB A         = dY W + s (dY B) A              (M, in)

The rank-r product `s X A^T` (M, r) is saved: it costs r/in of X and saves a matmul in backward.
W gets no gradient; an NF4 W is dequantized just in time into a shared workspace, in forward and
again in backward, so no 16-bit copy of it is kept. In the forward the adapter is merged in while
dequantizing where the shape allows (`_merges`, `kestrel.kernels.lora.nf4_lora`): W' = W + s B A,
and Y = X W'^T is one plain product, with no rank-r product at all in a pass with no backward to
come (a checkpoint's first pass). Projections of one input (Q/K/V; gate/up) share one shrink
product and one dA product, and their input gradients meet in one buffer. The MLP as one
Function is `kestrel.kernels.lora.mlp.lora_mlp`.

Rounding: adding the adapter term to an X W^T already rounded to 16 bits, as PEFT does, drops
every term under half a 16-bit unit of the output; B is small early in training, so most of each
update is lost (bench/RESULTS.md, QLoRA "Session 13"). Over NF4, W' is formed in fp32 and rounded
once. Over a 16-bit base the adapter term is written first and X W^T accumulated onto it: on a
CPU the GEMM adds in fp32 and rounds once; cuBLAS rounds X W^T to 16 bits first, so on CUDA both
orders lose small terms and speed picks the order (`_ADAPTER_FIRST_MIN`).
tests/kernels/test_lora_small_updates.py pins this down.

Matmuls go to cuBLAS through torch; compute runs in X's dtype (or autocast's), A and B cast to it.
A frozen base bias b (Qwen2's Q/K/V) rides in the first product's epilogue (`torch.addmm`):
Y = X W^T + b + s (X A^T) B^T, no pass of its own; it changes no gradient above, and a trainable
one is refused. Dropout, DoRA and an adapter bias are refused by `LoRAWeights.from_peft` with a
reason, so the caller keeps PEFT's forward.

Adapter off (`from_peft(..., adapter_off=True)`: PEFT's `disable_adapter()`, the DPO / KTO / GRPO
reference pass): scaling s = 0, so Y = X W^T exactly, and the forward skips every adapter product
(no shrink, no expansion, a plain dequantization instead of the merged one): the base runs
through the same dequantization and grouped products as the policy, not PEFT's per-projection
path. PEFT has set A and B to need no gradient meanwhile, so a backward gives them none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kestrel.kernels.lora import casts as lora_casts, peft as lora_peft, nf4_lora
from kestrel.kernels import nf4
from kestrel.kernels.lora.casts import cast, mm_to

_FIELDS = 5  # tensors/values per projection in a flattened autograd argument list


@dataclass
class LoRAWeights:
    """One LoRA projection. weight: the frozen base, `(out, in)` 16/32-bit, or NF4-packed uint8
    (a bitsandbytes `Params4bit`) with its `quant_state`; lora_A `(r, in)`; lora_B `(out, r)`;
    scaling: `lora_alpha / r` (or PEFT's rsLoRA value); bias: the base's frozen bias `(out,)`, or
    None. The bias is not among a Function's flattened fields (`_flat`): it needs no gradient, so
    the projections' Function takes the group's biases as one plain argument."""

    weight: torch.Tensor
    quant_state: Any | None
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        a_shape, b_shape = tuple(self.lora_A.shape), tuple(self.lora_B.shape)
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise ValueError(f"lora_A {a_shape} and lora_B {b_shape} are not (r, in) and (out, r)")
        base = tuple(self.weight.shape if self.quant_state is None else self.quant_state.shape)
        if base != (b_shape[0], a_shape[1]):
            expected = (b_shape[0], a_shape[1])
            raise ValueError(f"base weight {base} does not match the adapter's {expected}")
        if self.bias is not None and tuple(self.bias.shape) != (b_shape[0],):
            raise ValueError(f"bias {tuple(self.bias.shape)} is not ({b_shape[0]},), one value an output")

    @property
    def adapter_off(self) -> bool:
        """s = 0: the adapter adds nothing (Y = X W^T) and its products are skipped."""
        return self.scaling == 0.0

    @property
    def in_features(self) -> int:
        return self.lora_A.shape[1]

    @property
    def out_features(self) -> int:
        return self.lora_B.shape[0]

    @classmethod
    def from_peft(
        cls, layer: Any, adapter_name: str | None = None, adapter_off: bool = False
    ) -> tuple[LoRAWeights | None, str]:
        """Read a PEFT `lora.Linear` / `lora.bnb.Linear4bit` layer. Returns (weights, "") or, when
        the fused path would not compute what PEFT computes, (None, reason). adapter_off: the
        layer's adapters are disabled (PEFT then runs the base alone): weights with s = 0
        (`adapter_off`), whatever the adapter carries. Duck-typed: no peft import (it pulls in
        transformers)."""
        reason = lora_peft.refusal(layer, adapter_name, adapter_off)
        if reason:
            return None, reason
        name = adapter_name or layer.active_adapters[0]
        base = layer.get_base_layer()
        weight = base.weight
        quant_state = getattr(weight, "quant_state", None) if weight.dtype == torch.uint8 else None
        lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
        scaling = 0.0 if adapter_off else float(layer.scaling[name])
        return cls(weight, quant_state, lora_a, lora_b, scaling, getattr(base, "bias", None)), ""

    def _flat(self) -> tuple[Any, ...]:
        return (self.weight, self.quant_state, self.lora_A, self.lora_B, self.scaling)


# ---------------------------------------------------------------------------------------------
# Shared pieces: dtype policy, base weight, a group of projections' forward and backward.

# On CUDA, a base product at least this large (out * in) is compute-bound: the adapter's
# expansion is written into the output first and the base product accumulated onto it (cuBLAS
# reads it in the epilogue, nearly free), instead of a second read-and-write pass over the output
# after; below it (k and v of the 8B shape) the pass after is faster (bench/lora_layouts.py;
# bench/RESULTS.md, QLoRA "Session 5"). Elsewhere the adapter always goes first: that rounds the output once (module docstring).
_ADAPTER_FIRST_MIN = 1 << 23


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """X's dtype, or autocast's when autocast is on (the ops inside run with autocast off)."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def _base(weight: torch.Tensor, quant_state: Any, dtype: torch.dtype) -> torch.Tensor:
    """The base weight (out, in) in `dtype`: NF4 is dequantized into the shared workspace."""
    if quant_state is not None:
        return nf4.dequantize(weight, quant_state, dtype=dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)


def _merges(ws: list[LoRAWeights]) -> bool:
    """Whether the group's forward products run over W' = W + s B A (`nf4_lora`): every base NF4
    in a shape it can merge into. Also in a forward that saves for backward (a checkpoint's
    recompute): it still forms X A^T (dB needs it), but not the (M, out) expansions, and it
    reproduces the first pass's activations exactly (both round W' the same way), level in time
    with the separate adapter (bench/lora_merged.py; bench/RESULTS.md, QLoRA "Session 7")."""
    return all(w.quant_state is not None and nf4_lora.usable(w.quant_state) for w in ws)


def _merged(
    w: LoRAWeights, dtype: torch.dtype, out: torch.Tensor | None = None, a: torch.Tensor | None = None
) -> torch.Tensor:
    """W' = W + s B A (out, in) in `dtype`, in the NF4 workspace (or `out`). A and B go in
    already cast to `dtype` (kept from use to use, `kestrel.kernels.lora.casts`; `a`: A's rows of the
    group's stacked cast, which the backward uses too, so no copy of A is kept for this alone):
    the kernel rounds them to a 16-bit `dtype` anyway, and reading 16 bits instead of fp32 is
    faster (bench/nf4_tiles.py --quick; bench/RESULTS.md, QLoRA "Session 10")."""
    if w.adapter_off:  # W' = W: no adapter to read
        return nf4.dequantize(w.weight, w.quant_state, out=out, dtype=None if out is not None else dtype)
    a = cast(w.lora_A, dtype) if a is None else a
    return nf4_lora.dequantize_merged(w.weight, w.quant_state, a, cast(w.lora_B, dtype), w.scaling, dtype, out=out)


def _stacked_a(ws: list[LoRAWeights], dtype: torch.dtype) -> torch.Tensor:
    """[A_1; ...; A_n] (n r, in) in `dtype`: one shrink product for projections of one input
    (kept from use to use until an optimizer step, `kestrel.kernels.lora.casts`)."""
    return lora_casts.stacked([w.lora_A for w in ws], dtype)


def _spans(ws: list[LoRAWeights]) -> list[slice]:
    """Column span of projection k in a group's stacked rank-r products (ranks may differ)."""
    ends = [0]
    for w in ws:
        ends.append(ends[-1] + w.lora_A.shape[0])
    return [slice(a, b) for a, b in zip(ends, ends[1:])]


def _scale_columns_(t: torch.Tensor, ws: list[LoRAWeights]) -> torch.Tensor:
    """Scale t's column block k (projection k's rank columns) by s_k, in place."""
    if all(w.scaling == ws[0].scaling for w in ws):
        return t.mul_(ws[0].scaling)
    for span, w in zip(_spans(ws), ws):
        t[:, span].mul_(w.scaling)
    return t


def _shrink(x: torch.Tensor, ws: list[LoRAWeights], a: torch.Tensor) -> torch.Tensor:
    """x (M, in), a = [A_1; ...; A_n] -> xa = [s_1 x A_1^T | ... | s_n x A_n^T] (M, n r)."""
    return _scale_columns_(torch.mm(x, a.t()), ws)


def _mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """a @ b (+ bias, broadcast over rows, added in the product's epilogue), into `out` when given."""
    if bias is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b) if out is None else torch.addmm(bias, a, b, out=out)


def _expand(
    x: torch.Tensor, xa: torch.Tensor | None, w: LoRAWeights, dtype: torch.dtype, merged: bool,
    dense: torch.Tensor | None = None, a: torch.Tensor | None = None, out: torch.Tensor | None = None,
    adapter: bool = True,
) -> torch.Tensor:
    """y = x W^T + b + xa B^T (M, out) for x (M, in) and this projection's xa (M, r); merged: the
    adapter is inside W' (`_merged`, from A's cast rows `a` when given) and xa is not read.
    dense: W (W' when merged) already formed; otherwise it is dequantized (merged) here.
    out: where to write y (contiguous (M, out) in `dtype`), else a new tensor. Unmerged, the
    order of the two products is `_ADAPTER_FIRST_MIN`'s; the bias b (when the base has one) goes
    with whichever comes first. adapter=False (unmerged): x W^T + b alone, the caller adding xa B^T
    where it reads y (`kestrel.kernels.glu_lowrank`)."""
    bias = None if w.bias is None else cast(w.bias, dtype)
    if merged:
        return _mm(x, (_merged(w, dtype, a=a) if dense is None else dense).t(), bias, out)
    base = _base(w.weight, w.quant_state, dtype) if dense is None else dense
    if w.adapter_off or not adapter:
        return _mm(x, base.t(), bias, out)
    b = cast(w.lora_B, dtype)
    if x.is_cuda and w.out_features * w.in_features < _ADAPTER_FIRST_MIN:
        return _mm(x, base.t(), bias, out).addmm_(xa, b.t())
    return _mm(xa, b.t(), bias, out).addmm_(x, base.t())


def _adapter_backward(
    ctx: Any, first: int, dys: list[torch.Tensor], x: torch.Tensor | None, xa: torch.Tensor,
    ws: list[LoRAWeights], dtype: torch.dtype, grads: list[torch.Tensor | None],
) -> torch.Tensor:
    """The adapter part of the backward of y_k = x W_k^T + s_k (x A_k^T) B_k^T, k = 1..n, given
    dy_k (M, out_k) and xa = [s_k x A_k^T]_k (M, n r). Writes dB_k, and dA_k when x is given,
    into `grads` (projection k's fields start at first + _FIELDS k); returns dyb:

        dyb  = [s_k dy_k B_k]_k                   (M, n r)
        dA   = dyb^T x                            (n r, in), one product for the group
        dB_k = dy_k^T xa_k                        (out_k, r)
    """
    spans = _spans(ws)
    parts = [torch.mm(dy, cast(w.lora_B, dtype)) for dy, w in zip(dys, ws)]  # (M, r) each
    dyb = _scale_columns_(parts[0] if len(parts) == 1 else torch.cat(parts, 1), ws)
    need_a = [_needs(ctx, first, k)[0] for k in range(len(ws))]
    if x is not None and any(need_a):
        da = mm_to(dyb.t(), x, ws[0].lora_A.dtype)  # (n r, in)
        for k in range(len(ws)):
            grads[first + _FIELDS * k + 2] = da[spans[k]] if need_a[k] else None
    for k, (dy, w) in enumerate(zip(dys, ws)):
        if _needs(ctx, first, k)[1]:
            grads[first + _FIELDS * k + 3] = mm_to(dy.t(), xa[:, spans[k]], w.lora_B.dtype)
    return dyb


def _input_backward(
    dys: list[torch.Tensor], dyb: torch.Tensor, a: torch.Tensor, ws: list[LoRAWeights], dtype: torch.dtype,
    dense: list[torch.Tensor] | None = None, merged: bool = False, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dX = dyb a + sum_k dy_k W_k (M, in), a = [A_k]_k (n r, in): the base products accumulated
    onto the adapter term in their epilogues. dense: the W_k already formed (else each is
    dequantized again into the workspace); merged: they are W'_k = W_k + s_k B_k A_k (dense
    required), and
    dX = sum_k dy_k W'_k, the same sum (s_k dy_k B_k A_k is the dyb a term) as plain products.
    out: where dX goes."""
    if merged:  # dense given
        dx = torch.mm(dys[0], dense[0], out=out)
        for dy, wm in zip(dys[1:], dense[1:]):
            dx.addmm_(dy, wm)
        return dx
    dx = torch.mm(dyb, a, out=out)
    for k, (dy, w) in enumerate(zip(dys, ws)):
        dx.addmm_(dy, _base(w.weight, w.quant_state, dtype) if dense is None else dense[k])
    return dx


def _group_backward(
    ctx: Any, first: int, dys: list[torch.Tensor], x: torch.Tensor, xa: torch.Tensor,
    a: torch.Tensor, ws: list[LoRAWeights], dtype: torch.dtype, grads: list[torch.Tensor | None],
    dense: list[torch.Tensor] | None = None, merged: bool = False, out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The whole backward of projections of one input x: `_adapter_backward`, then dX
    (`_input_backward`, over `dense` weights when given) when x needs a gradient."""
    dyb = _adapter_backward(ctx, first, dys, x, xa, ws, dtype, grads)
    if not ctx.needs_input_grad[0]:
        return None
    return _input_backward(dys, dyb, a, ws, dtype, dense, merged, out)


def _needs_shrink(grad: bool, merged: bool, ws: list[LoRAWeights] | tuple[LoRAWeights, ...]) -> bool:
    """Whether a forward forms the rank-r products X A^T: for backward (dB needs them), or for
    unmerged expansions of an adapter that is on."""
    return grad or not (merged or all(w.adapter_off for w in ws))


def _will_backward(x: torch.Tensor, ws: list[LoRAWeights]) -> bool:
    """Whether autograd will record the call (a checkpoint's no-grad first pass will not: then
    nothing is saved, and a merged group forms no X A^T at all)."""
    return torch.is_grad_enabled() and (
        x.requires_grad or any(w.lora_A.requires_grad or w.lora_B.requires_grad for w in ws)
    )


def _unflatten(args: tuple[Any, ...], biases: tuple[torch.Tensor | None, ...] | None = None) -> list[LoRAWeights]:
    """The projections of a flattened argument list (`_flat` each), with their biases when given."""
    n = len(args) // _FIELDS
    return [LoRAWeights(*args[k * _FIELDS : (k + 1) * _FIELDS], bias)
            for k, bias in enumerate(biases if biases is not None else (None,) * n)]


def _biases(ws: list[LoRAWeights] | tuple[LoRAWeights, ...]) -> tuple[torch.Tensor | None, ...]:
    """The group's base biases, one plain Function argument (`LoRAWeights.bias`)."""
    return tuple(w.bias for w in ws)


def _save(ctx: Any, ws: list[LoRAWeights] | tuple[LoRAWeights, ...], *saved: torch.Tensor) -> None:
    """Save `saved`, then each projection's (weight, A, B); quant_state and scaling go on ctx."""
    ctx.save_for_backward(*saved, *(t for w in ws for t in (w.weight, w.lora_A, w.lora_B)))
    ctx.meta = [(w.quant_state, w.scaling) for w in ws]


def _rebuild(tensors: list[torch.Tensor], meta: list[tuple[Any, float]]) -> list[LoRAWeights]:
    """Inverse of `_save` for the projections' part of `ctx.saved_tensors`."""
    return [
        LoRAWeights(tensors[3 * k], quant_state, tensors[3 * k + 1], tensors[3 * k + 2], scaling)
        for k, (quant_state, scaling) in enumerate(meta)
    ]


def _needs(ctx: Any, first: int, k: int) -> tuple[bool, bool]:
    """needs_input_grad of (lora_A, lora_B) of projection k whose fields start at `first`."""
    base = first + _FIELDS * k
    return ctx.needs_input_grad[base + 2], ctx.needs_input_grad[base + 3]


# ---------------------------------------------------------------------------------------------
# lora_linear and lora_qkv: N projections of one input.


class _LoRAProjections(torch.autograd.Function):
    """Y_k = X W_k^T + s_k (X A_k^T) B_k^T for k = 1..N, all from one X (N = 1: a linear;
    N = 3: Q, K, V). One shrink product X [A_1; ...; A_N]^T serves all N. Backward
    (`_group_backward`, dY_k (M, out_k)): one dA product for the group, and the N input
    gradients summed into ONE (M, in) buffer:

        dX = sum_k  dY_k W_k + s_k (dY_k B_k) A_k
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grad: bool, biases: tuple[torch.Tensor | None, ...],
                *flat: Any) -> tuple[torch.Tensor, ...]:
        dtype, lead, ws = _compute_dtype(x), x.shape[:-1], _unflatten(flat, biases)
        merged = _merges(ws)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (M, in)
            a = _stacked_a(ws, dtype)  # (N r, in)
            xa = _shrink(x2, ws, a) if _needs_shrink(grad, merged, ws) else None  # (M, N r)
            outs = []
            for span, w in zip(_spans(ws), ws):
                y = _expand(x2, None if xa is None else xa[:, span], w, dtype, merged, a=a[span])
                # A fresh tensor, not a view of y: autograd forbids in-place updates (RoPE) on
                # views returned by a function with several outputs.
                outs.append(torch.ops.aten._unsafe_view(y, (*lead, w.out_features)))
        if grad:
            _save(ctx, ws, x2, xa, a)
        ctx.dtype, ctx.x_dtype, ctx.x_shape = dtype, x.dtype, x.shape
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *dys: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, xa, a, *rest = ctx.saved_tensors
        ws, dtype = _rebuild(rest, ctx.meta), ctx.dtype
        grads: list[torch.Tensor | None] = [None] * (3 + _FIELDS * len(ws))  # x, grad, biases, fields
        with torch.autocast(x2.device.type, enabled=False):
            dy2 = [dy.reshape(-1, dy.shape[-1]).to(dtype) for dy in dys]  # (M, out_k)
            dx = _group_backward(ctx, 3, dy2, x2, xa, a, ws, dtype, grads)
        if dx is not None:
            grads[0] = dx.view(ctx.x_shape).to(ctx.x_dtype)
        return tuple(grads)


class _KnownProjections(_LoRAProjections):
    """Y_k = X W_k^T + b_k + s_k (X A_k^T) B_k^T, k = 1..N, whose values are already known (`known`: the
    first pass's, kept by a checkpoint): the forward forms only the rank-r X [A_k]^T that dB needs, no base
    product, and returns `known`; the backward is `_LoRAProjections`' own (its arguments sit where that
    one's do: x, then `known` in place of `grad`, the biases, the fields). `known` is not an input of the
    Function: its memory is the kept buffers', and it takes no gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, known: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...],
                *flat: Any) -> tuple[torch.Tensor, ...]:
        dtype, ws = _compute_dtype(x), _unflatten(flat, biases)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (M, in)
            a = _stacked_a(ws, dtype)  # (N r, in)
            xa = _shrink(x2, ws, a)  # (M, N r)
        _save(ctx, ws, x2, xa, a)
        ctx.dtype, ctx.x_dtype, ctx.x_shape = dtype, x.dtype, x.shape
        return tuple(torch.ops.aten._unsafe_view(y, y.shape) for y in known)  # fresh tensors, as the forward's


def lora_linear_known(x: torch.Tensor, w: LoRAWeights, known: torch.Tensor) -> torch.Tensor:
    """`lora_linear(x, w)` whose value `known` (..., out) the caller already has (a checkpoint's recompute of
    a projection whose first-pass output was kept): no base product runs; the gradients are lora_linear's."""
    return _KnownProjections.apply(x, (known,), _biases([w]), *w._flat())[0]


def lora_projections_known(x: torch.Tensor, ws: tuple[LoRAWeights, ...], known: tuple[torch.Tensor, ...]
                           ) -> tuple[torch.Tensor, ...]:
    """`lora_projections(x, *ws)` whose values `known` (one (..., out_k) each) the caller already has (a
    checkpoint's recompute of Q/K/V whose first-pass outputs were kept): no base product runs; the gradients
    are lora_projections'."""
    return _KnownProjections.apply(x, tuple(known), _biases(ws), *(t for w in ws for t in w._flat()))


def lora_linear(x: torch.Tensor, w: LoRAWeights) -> torch.Tensor:
    """x (..., in) -> x W^T + b + s (x A^T) B^T (..., out); backward by hand (module docstring)."""
    return _LoRAProjections.apply(x, _will_backward(x, [w]), _biases([w]), *w._flat())[0]


def lora_projections(x: torch.Tensor, *ws: LoRAWeights) -> tuple[torch.Tensor, ...]:
    """x (..., in) -> one (..., out_k) output per projection of `ws`, all of one input, as one
    autograd Function: one shrink product for all, backward sums their dX contributions into one
    buffer (no autograd adds). Q/K/V, or a linear-attention layer's in_proj_qkv and in_proj_z."""
    return _LoRAProjections.apply(x, _will_backward(x, list(ws)), _biases(ws), *(t for w in ws for t in w._flat()))


def lora_qkv(
    x: torch.Tensor, q: LoRAWeights, k: LoRAWeights, v: LoRAWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., hidden) -> (Q (..., out_q), K (..., out_k), V (..., out_v)): `lora_projections`
    of the three."""
    return lora_projections(x, q, k, v)  # type: ignore[return-value]
