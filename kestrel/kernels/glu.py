"""Gated linear units of the MLP: SwiGLU (Llama, Mistral, Qwen) and GeGLU (Gemma).

    swiglu: c = silu(a) * b           silu(a) = a * sigmoid(a)
    geglu:  c = gelu_tanh(a) * b      gelu_tanh(a) = 0.5 a (1 + tanh(z)) = a * sigmoid(2z),
                                      z = sqrt(2/pi) (a + 0.044715 a^3)

with a = gate, b = up. As in HF, the activation is rounded to the input dtype before the
multiply. Layout: gate/up (..., n) viewed as rows (n_rows, n) with any row stride and unit
column stride; grid (n_rows, cdiv(n, BLOCK)). Only gate and up are saved; the backward
recomputes the activation from them.

Tiles (`_tiles`): BLOCK = next_pow2(n) columns per program, capped at 16,384 for SwiGLU and
8,192 for GeGLU (wider rows take several programs), with 16 warps from 8,192 columns, 8 from
2,048, else 4: the fastest in a sweep at the 8B MLP's 14,336 columns (`bench/glu_tiles.py`;
bench/RESULTS.md, Kernels "Session 14"). 16,384-column tiles slow the backward down at fewer
warps, and GeGLU's longer backward even at 16. Under 256 rows (a decode step, a short prompt) a
row per program would leave most of the GPU idle: those keep 1,024-column tiles at 4 warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels._launch import launch
from kestrel.kernels._utils import as_rows
from kestrel.kernels.dispatch import use_triton

_MAX_BLOCK = 16384  # SwiGLU: columns per program; wider rows take several programs
_GELU_MAX_BLOCK = 8192  # GeGLU's longer backward is slower at 16,384
_FEW_ROWS, _FEW_ROWS_BLOCK = 256, 1024  # decode-sized inputs: more, smaller programs
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_C = tl.constexpr(0.044715)


@triton.jit
def _act_and_grad(a, GELU: tl.constexpr):
    """(act(a), act'(a)) in fp32."""
    if GELU:
        z = _SQRT_2_OVER_PI * (a + _GELU_C * a * a * a)
        s = tl.sigmoid(2.0 * z)
        # d/da [a * s(2z)] = s + a * s (1 - s) * 2 dz/da
        d = s + a * s * (1.0 - s) * 2.0 * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * a * a)
    else:
        s = tl.sigmoid(a)
        d = s * (1.0 + a * (1.0 - s))
    return a * s, d


@triton.jit
def _glu_fwd_kernel(
    C, c_row_stride, A, a_row_stride, B, b_row_stride, n_cols,
    GELU: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(A + row * a_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + row * b_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(a, GELU)
    act = act.to(A.dtype.element_ty).to(tl.float32)  # HF: act_fn(gate) is in gate's dtype
    tl.store(C + row * c_row_stride + cols, (act * b).to(C.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    DA, da_row_stride, DB, db_row_stride, DC, dc_row_stride,
    A, a_row_stride, B, b_row_stride, n_cols,
    GELU: tl.constexpr, BLOCK: tl.constexpr,
):
    # DA/DB may alias A/B (in-place backward): every element is read before it is written, by
    # the same program.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dc = tl.load(DC + row * dc_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + row * a_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + row * b_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(a, GELU)
    db = dc * act.to(A.dtype.element_ty).to(tl.float32)
    da = dc * b * dact
    tl.store(DA + row * da_row_stride + cols, da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + row * db_row_stride + cols, db.to(DB.dtype.element_ty), mask=mask)


def _tiles(n_rows: int, n_cols: int, gelu: bool) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK, num_warps) for rows of n_cols (module docstring: Tiles)."""
    cap = _FEW_ROWS_BLOCK if n_rows < _FEW_ROWS else _GELU_MAX_BLOCK if gelu else _MAX_BLOCK
    block = min(cap, triton.next_power_of_2(max(n_cols, 1)))
    warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return (n_rows, triton.cdiv(n_cols, block)), block, warps


def glu_forward(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """c = act(gate) * up. gate, up (..., n) of one shape -> c (..., n), dtype promote(gate, up)."""
    a, b = as_rows(gate), as_rows(up)
    n_rows, n_cols = a.shape
    c = torch.empty((n_rows, n_cols), dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if c.numel() > 0:
        grid, block, warps = _tiles(n_rows, n_cols, gelu)
        launch(_glu_fwd_kernel, grid, c, c.stride(0), a, a.stride(0), b, b.stride(0), n_cols, gelu, block,
               num_warps=warps)
    return c.view(gate.shape)


def glu_backward(
    dc: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gelu: bool, inplace: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of c = act(a) * b with respect to a = gate and b = up:

        da = dc * b * act'(a)        db = dc * act(a)

    silu'(a) = s (1 + a (1 - s)), s = sigmoid(a);
    gelu_tanh'(a) = s + 2 a s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 a^2), s = sigmoid(2z).
    With inplace=True, da and db are written over gate's and up's storage (no new memory) and
    the version counters of gate and up are bumped.
    """
    a, b, dc_rows = as_rows(gate), as_rows(up), as_rows(dc)
    n_rows, n_cols = a.shape
    if inplace:
        da, db = a, b
    else:
        da, db = torch.empty_like(a), torch.empty_like(b)
    if a.numel() > 0:
        grid, block, warps = _tiles(n_rows, n_cols, gelu)
        launch(
            _glu_bwd_kernel, grid, da, da.stride(0), db, db.stride(0), dc_rows, dc_rows.stride(0),
            a, a.stride(0), b, b.stride(0), n_cols, gelu, block, num_warps=warps,
        )
    if inplace:
        # gate/up now hold gradients: a later reader that saved them (a retained graph) fails
        # its version check instead of computing with garbage. Bumped before the views below
        # are made, so those views stay valid to use with grad mode on.
        torch.autograd.graph.increment_version(gate)
        torch.autograd.graph.increment_version(up)
    return da.reshape(gate.shape), db.reshape(up.shape)


class _GLUFunction(torch.autograd.Function):
    """Saves gate and up only; the backward recomputes the activation."""

    @staticmethod
    def forward(ctx, gate, up, gelu, inplace):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        ctx.gelu, ctx.inplace = gelu, inplace
        return glu_forward(gate, up, gelu)

    @staticmethod
    def backward(ctx, dc):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        da, db = glu_backward(dc, gate, up, ctx.gelu, ctx.inplace)
        return da, db, None, None


def act_and_grad_reference(e: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(e), act'(e)) in e's dtype (call with fp32), `_act_and_grad`'s math in PyTorch:
    silu(e) = e s, s = sigmoid(e):                silu'(e) = s (1 + e (1 - s))
    gelu_tanh(e) = e s, s = sigmoid(2z), z = sqrt(2/pi) (e + 0.044715 e^3):
                                                  gelu_tanh'(e) = s + 2 e s (1 - s) dz/de"""
    if not gelu:
        s = torch.sigmoid(e)
        return e * s, s * (1.0 + e * (1.0 - s))
    c = 0.7978845608028654
    s = torch.sigmoid(2.0 * c * (e + 0.044715 * e * e * e))
    return e * s, s + 2.0 * e * s * (1.0 - s) * c * (1.0 + 3.0 * 0.044715 * e * e)


def glu_grads_reference(e: torch.Tensor, g: torch.Tensor, dh: torch.Tensor, gelu: bool,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """For h = act(e) * g, fp32 e, g, dh: (de, dg) = (dh * g * act'(e), dh * act(e)) in fp32, act(e) rounded to
    `dtype` first, as HF (and the kernels) do."""
    act, grad = act_and_grad_reference(e, gelu)
    return dh * g * grad, dh * act.to(dtype).float()


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's `ACT2FN["silu"](gate) * up` in plain PyTorch."""
    return torch.nn.functional.silu(gate) * up


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's `ACT2FN["gelu_pytorch_tanh"](gate) * up` in plain PyTorch."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def _inplace_allowed(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """In-place gradients need gate and up to be autograd intermediates (not user-held leaves
    or views of them) that do not share elements."""
    for t in (gate, up):
        base = t if t._base is None else t._base
        if base.is_leaf:
            return False
    return gate.data_ptr() != up.data_ptr()


def _glu(gate: torch.Tensor, up: torch.Tensor, gelu: bool, inplace_backward: bool) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if use_triton(gate, up):
        inplace = inplace_backward and _inplace_allowed(gate, up)
        return _GLUFunction.apply(gate, up, gelu, inplace)
    return (swiglu_reference if not gelu else geglu_reference)(gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """silu(gate) * up. gate, up (..., intermediate) of one shape -> same shape.

    inplace_backward=True lets the backward write d(gate), d(up) over gate's and up's storage
    (saves two activation-sized buffers). Only for fresh activations nothing else reads, such
    as gate_proj(x) and up_proj(x) inside an MLP; it is ignored for leaves. The version
    counters are bumped, so a retained graph that would reuse them fails loudly.
    """
    return _glu(gate, up, gelu=False, inplace_backward=inplace_backward)


def geglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's `gelu_pytorch_tanh`); see `swiglu` for inplace_backward."""
    return _glu(gate, up, gelu=True, inplace_backward=inplace_backward)
