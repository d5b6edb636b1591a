"""Rotary position embedding applied to q and k in place, in one launch (HF `rotate_half` form).

With x = [x1, x2] split at half = head_dim / 2, and cos = [c1, c2], sin = [s1, s2] likewise:

    forward:   y1 = x1 * c1 - x2 * s1        y2 = x2 * c2 + x1 * s2
    backward:  dx1 = dy1 * c1 + dy2 * s2     dx2 = dy2 * c2 - dy1 * s1

The backward is the transpose of the forward (for HF's tables, where c1 == c2 and s1 == s2, a
rotation by -sin). It overwrites the incoming gradient when that is known to be safe (a copy it
made itself, or the caller's promise, `rope_(..., inplace_backward=True)`; see `_grad_buffers`)
and writes a fresh buffer otherwise. Either way each gradient element is read once and written
once: in place saves memory, not time.

Layout: q (batch, heads_q, seq, head_dim), k (batch, heads_k, seq, head_dim), any strides (HF
hands in transposed views of (batch, seq, heads, head_dim)); nothing is copied. cos/sin hold one
(head_dim,) row per token. Grid (batch * cdiv(seq, TOKENS),): a program rotates TOKENS
consecutive tokens of one sequence, every head of q and of k, so each cos/sin row is read once;
all its loads (q and k, both halves) are issued before its first store. Head counts and head_dim
are compile-time constants, so an exact tile (power-of-two heads and half) has no masks. Token
and head offsets are int64 (a q of 2^31 elements is real), offsets within a head int32.

Small shapes are bound by the host: all that depends on shapes and strides alone comes from
lru-cached pure functions (`_plan`, `_launch`, `_geometry`), so a call is a few cache lookups,
the autograd Function and one launch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kestrel.kernels._launch import launch as launch_kernel
from kestrel.kernels._utils import cdiv, layout_dense, layout_non_overlapping, next_pow2
from kestrel.kernels.dispatch import use_triton

# Elements a program moves (q and k, both halves, TOKENS tokens): at least this many, a few
# tokens at a time for small heads. Llama-3-8B (32 + 8 heads of 128) gets one token (5120
# elements, 40 a thread at 4 warps), the tile Liger-Kernel's RoPE runs at copy bandwidth with.
_TILE = 4096
# Up to this many elements a program (64 a thread), 4 warps; above it, 8. Llama-3-8B's 5120 at 4
# warps compile to 56-64 registers (ptxas, sm_90): eight programs, 80 KB of loads, per SM.
_MAX_ELEMENTS_AT_4_WARPS = 8192


@triton.jit
def _head_tile(tok, sh, sd, tok_mask, HEADS: tl.constexpr, HALF: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, MASK_TOKENS: tl.constexpr):
    """Offsets (TOKENS, BLOCK_H, BLOCK_D) of the first half of every head of the tokens whose
    offsets are `tok` (TOKENS,), and their mask (a constant True, which the compiler drops, for
    an exact tile)."""
    heads = tl.arange(0, BLOCK_H).to(tl.int64)[None, :, None]
    dims = tl.arange(0, BLOCK_D)[None, None, :]
    lo = tok[:, None, None] + heads * sh + dims * sd
    mask = tl.full([1, 1, 1], True, tl.int1)  # broadcast over the tile by the loads
    if BLOCK_H != HEADS or BLOCK_D != HALF:
        mask = (heads < HEADS) & (dims < HALF)
    if MASK_TOKENS:
        mask = mask & tok_mask[:, None, None]
    return lo, mask


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, BACKWARD: tl.constexpr):
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    return y1, y2


@triton.jit
def _cos_sin(COS, SIN, cs_row, cs_sd, tok_mask, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
             MASK_TOKENS: tl.constexpr):
    """c1, c2, s1, s2 of the rows at offsets `cs_row` (TOKENS,), fp32, shaped (TOKENS, 1, BLOCK_D)."""
    dims = tl.arange(0, BLOCK_D)[None, :]
    lo = cs_row[:, None] + dims * cs_sd
    hi = lo + HALF * cs_sd
    mask = tl.full([1, 1], True, tl.int1)
    if BLOCK_D != HALF or MASK_TOKENS:
        mask = tok_mask[:, None] & (dims < HALF)
    c1 = tl.load(COS + lo, mask=mask).to(tl.float32)[:, None, :]
    c2 = tl.load(COS + hi, mask=mask).to(tl.float32)[:, None, :]
    s1 = tl.load(SIN + lo, mask=mask).to(tl.float32)[:, None, :]
    s2 = tl.load(SIN + hi, mask=mask).to(tl.float32)[:, None, :]
    return c1, c2, s1, s2


@triton.jit
def _rope_kernel(
    Q, OQ, K, OK, COS, SIN, POS,
    q_sb, q_sh, q_ss, q_sd, k_sb, k_sh, k_ss, k_sd, cs_sb, cs_ss, cs_sd, pos_sb, pos_ss, seq_len,
    HEADS_Q: tl.constexpr, HEADS_K: tl.constexpr, HALF: tl.constexpr, TOKENS: tl.constexpr,
    HAS_POS: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    # grid: (batch * cdiv(seq_len, TOKENS),), sequence blocks fastest. Reads Q/K, writes OQ/OK
    # (the same tensors in place). Masked lanes load garbage that only reaches masked stores.
    # Pointers first, then the runtime ints, then the constexprs (the order `_Launch` packs).
    MASK_TOKENS: tl.constexpr = TOKENS > 1  # with one token a program the grid is exact
    seq_blocks = tl.cdiv(seq_len, TOKENS)
    pid = tl.program_id(0)
    b = (pid // seq_blocks).to(tl.int64)
    s = (pid % seq_blocks) * TOKENS + tl.arange(0, TOKENS)
    tok_mask = s < seq_len
    s = s.to(tl.int64)
    if HAS_POS:
        # cos/sin are (max_pos, head_dim) tables; the row is this token's position id.
        cs_row = tl.load(POS + b * pos_sb + s * pos_ss, mask=tok_mask).to(tl.int64) * cs_ss
    else:
        # cos/sin are (batch or 1, seq, head_dim); cs_sb is 0 when shared over the batch.
        cs_row = b * cs_sb + s * cs_ss
    c1, c2, s1, s2 = _cos_sin(COS, SIN, cs_row, cs_sd, tok_mask, HALF, BLOCK_D, MASK_TOKENS)
    q_lo, q_mask = _head_tile(b * q_sb + s * q_ss, q_sh, q_sd, tok_mask,
                              HEADS_Q, HALF, BLOCK_HQ, BLOCK_D, MASK_TOKENS)
    q1 = tl.load(Q + q_lo, mask=q_mask).to(tl.float32)
    q2 = tl.load(Q + q_lo + HALF * q_sd, mask=q_mask).to(tl.float32)
    if HEADS_K > 0:
        k_lo, k_mask = _head_tile(b * k_sb + s * k_ss, k_sh, k_sd, tok_mask,
                                  HEADS_K, HALF, BLOCK_HK, BLOCK_D, MASK_TOKENS)
        k1 = tl.load(K + k_lo, mask=k_mask).to(tl.float32)
        k2 = tl.load(K + k_lo + HALF * k_sd, mask=k_mask).to(tl.float32)
    y1, y2 = _rotate(q1, q2, c1, c2, s1, s2, BACKWARD)
    tl.store(OQ + q_lo, y1.to(OQ.dtype.element_ty), mask=q_mask)
    tl.store(OQ + q_lo + HALF * q_sd, y2.to(OQ.dtype.element_ty), mask=q_mask)
    if HEADS_K > 0:
        y1, y2 = _rotate(k1, k2, c1, c2, s1, s2, BACKWARD)
        tl.store(OK + k_lo, y1.to(OK.dtype.element_ty), mask=k_mask)
        tl.store(OK + k_lo + HALF * k_sd, y2.to(OK.dtype.element_ty), mask=k_mask)


def _table_strides(
    q_shape: torch.Size, cos_shape: torch.Size, cos_stride: tuple[int, ...], sin_shape: torch.Size,
    pos_shape: torch.Size | None, pos_stride: tuple[int, ...] | None,
) -> tuple[tuple[int, int, int, int, int], bool]:
    """Validate cos/sin (and position ids) against q (batch, heads, seq, head_dim); return the
    kernel's table ints (cs_sb, cs_ss, cs_sd, pos_sb, pos_ss) and whether ids index the tables.

    cos/sin are read as 3-D (1 or batch, rows, head_dim): cs_sb is 0 when one table serves the
    batch or when position ids pick the rows; likewise pos_sb for one id row shared by the batch.
    """
    batch, _, seq, head_dim = q_shape
    if cos_shape != sin_shape:
        raise ValueError(f"cos {tuple(cos_shape)} and sin {tuple(sin_shape)} differ")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if pos_shape is not None:
        if len(cos_shape) == 3 and cos_shape[0] == 1:
            cos_shape, cos_stride = cos_shape[1:], cos_stride[1:]
        if len(cos_shape) != 2 or cos_shape[1] != head_dim:
            raise ValueError(f"with position_ids, cos/sin must be (max_pos, {head_dim}), got "
                             f"{tuple(cos_shape)}")
        if len(pos_shape) != 2 or pos_shape[1] != seq or pos_shape[0] not in (1, batch):
            raise ValueError(f"position_ids must be ({batch} or 1, {seq}), got {tuple(pos_shape)}")
        pos_sb = pos_stride[0] if pos_shape[0] > 1 else 0
        return (0, cos_stride[0], cos_stride[1], pos_sb, pos_stride[1]), True
    if len(cos_shape) == 2:
        cos_shape, cos_stride = (1, *cos_shape), (0, *cos_stride)
    if len(cos_shape) != 3 or tuple(cos_shape[1:]) != (seq, head_dim) or cos_shape[0] not in (1, batch):
        raise ValueError(f"cos/sin must be ({batch} or 1, {seq}, {head_dim}), got {tuple(cos_shape)}")
    return (cos_stride[0] if cos_shape[0] > 1 else 0, cos_stride[1], cos_stride[2], 0, 0), False


def _config(seq_block: int, heads_q: int, heads_k: int, head_dim: int) -> tuple[int, ...] | None:
    """(HALF, TOKENS, BLOCK_HQ, BLOCK_HK, BLOCK_D, num_warps) of the kernel (see _TILE), or None
    when a token holds nothing to rotate. seq_block: next_pow2(seq), capped at _TILE, so short
    sequences get short tiles."""
    half = head_dim // 2
    block_d = next_pow2(half)
    block_hq = next_pow2(heads_q)
    block_hk = next_pow2(heads_k) if heads_k else 0
    per_token = 2 * block_d * (block_hq + block_hk)
    if per_token == 0:
        return None
    tokens = min(1 << (max(1, _TILE // per_token).bit_length() - 1), seq_block)
    warps = 4 if tokens * per_token <= _MAX_ELEMENTS_AT_4_WARPS else 8
    return half, tokens, block_hq, max(block_hk, 1), block_d, warps


class _Launch(NamedTuple):
    """A launch of `_rope_kernel` less its tensors: the grid; the runtime ints then constexprs
    in the kernel's order, ending in BACKWARD=False (`forward`) or True (`backward`); num_warps."""

    grid: tuple[int]
    forward: tuple
    backward: tuple
    num_warps: int


@functools.lru_cache(maxsize=512)
def _launch(
    q_shape: torch.Size, q_stride: tuple[int, ...], heads_k: int, k_stride: tuple[int, ...] | None,
    tables: tuple[int, ...], has_pos: bool,
) -> _Launch | None:
    """The launch rotating q (batch, heads_q, seq, head_dim) of strides `q_stride` and, when
    heads_k > 0, k (batch, heads_k, seq, head_dim) of strides `k_stride`; None when there is
    nothing to rotate. The output buffers must have their input's strides."""
    batch, heads_q, seq, head_dim = q_shape
    config = _config(min(next_pow2(seq), _TILE), heads_q, heads_k, head_dim) if batch * seq else None
    if config is None:
        return None
    half, tokens, block_hq, block_hk, block_d, warps = config
    ints = (*q_stride, *(q_stride if k_stride is None else k_stride), *tables, seq)
    head = (*ints, heads_q, heads_k, half, tokens, has_pos, block_hq, block_hk, block_d)
    return _Launch((batch * cdiv(seq, tokens),), (*head, False), (*head, True), warps)


def _run(
    launch: _Launch | None, backward: bool, q: torch.Tensor, out_q: torch.Tensor, k: torch.Tensor,
    out_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None,
) -> None:
    """Launch `launch` on these tensors. Only their data pointers and dtypes are read: the
    strides are the launch's, so a tensor may be the root of the view they describe (same
    storage offset). With HEADS_K = 0, k and out_k are never touched."""
    if launch is not None:
        launch_kernel(
            _rope_kernel, launch.grid, q, out_q, k, out_k, cos, sin, cos if position_ids is None else position_ids,
            *(launch.backward if backward else launch.forward), num_warps=launch.num_warps,
        )


class _Plan(NamedTuple):
    """What `rope_` derives from shapes and strides alone (see `_plan`)."""

    copy_tables: bool  # cos/sin must be made contiguous to share one unit-last-dim stride set
    tables: tuple[int, int, int, int, int]  # cs_sb, cs_ss, cs_sd, pos_sb, pos_ss
    has_pos: bool
    launch: _Launch | None  # q with k, at the caller's strides


@functools.lru_cache(maxsize=512)
def _plan(
    q_shape: torch.Size, q_stride: tuple[int, ...], k_shape: torch.Size, k_stride: tuple[int, ...],
    cos_shape: torch.Size, cos_stride: tuple[int, ...], sin_shape: torch.Size, sin_stride: tuple[int, ...],
    pos_shape: torch.Size | None, pos_stride: tuple[int, ...] | None,
) -> _Plan:
    """Check q, k, cos, sin and position ids (ValueError, for both backends) and derive the
    launch, from their shapes and strides only: cached, so a repeated geometry costs one lookup
    and a new one (another seq length, another stride) gets its own plan."""
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise ValueError(
            f"q and k must be 4-D (batch, heads, seq, head_dim), got {len(q_shape)}-D/{len(k_shape)}-D")
    if k_shape[0] != q_shape[0] or k_shape[2:] != q_shape[2:]:
        raise ValueError(f"q {tuple(q_shape)} and k {tuple(k_shape)} disagree on batch/seq/head_dim")
    if not (layout_non_overlapping(q_shape, q_stride) and layout_non_overlapping(k_shape, k_stride)):
        raise ValueError("q and k are written in place and must not have overlapping elements")
    tables, has_pos = _table_strides(q_shape, cos_shape, cos_stride, sin_shape, pos_shape, pos_stride)
    copy_tables = cos_stride[-1] != 1 or sin_stride != cos_stride
    return _Plan(copy_tables, tables, has_pos, _launch(q_shape, q_stride, k_shape[1], k_stride, tables, has_pos))


Geometry = tuple[tuple[int, ...], tuple[int, ...]]  # (shape in memory order, inverse permutation)


def _root(t: torch.Tensor) -> tuple[torch.Tensor, Geometry] | None:
    """The non-view tensor that `t` covers exactly, and how to rebuild `t` from it with `view` +
    `permute` (whose backward passes are free). None when `t` covers only part of its storage
    (a slice of a fused QKV projection) or its root is not contiguous.

    HF's q is `linear(x).view(b, s, h, d).transpose(1, 2)`: the root is the linear's output, at
    the same storage offset (so the same data pointer). No view is made here.
    """
    root = t if t._base is None else t._base
    if root.requires_grad != t.requires_grad:
        # t is a view made inside an autograd Function: its gradient flows through t's own node,
        # not through `_base`, so the root must not be used.
        return None
    if not root.is_contiguous() or root.numel() != t.numel() or root.storage_offset() != t.storage_offset():
        return None
    geometry = _geometry(t.shape, t.stride())
    return None if geometry is None else (root, geometry)


@functools.lru_cache(maxsize=512)
def _geometry(shape: torch.Size, strides: tuple[int, ...]) -> Geometry | None:
    """How a tensor of `shape` and `strides` is rebuilt from a contiguous root of as many
    elements (see `_root`), or None when its strides are no permutation of a contiguous layout."""
    perm = sorted(range(len(shape)), key=strides.__getitem__, reverse=True)
    mem_shape = tuple(shape[i] for i in perm)
    expected = 1  # `root.view(mem_shape)` is contiguous: walk its strides from the last dimension
    for i, size in zip(reversed(perm), reversed(mem_shape)):
        if size > 1 and strides[i] != expected:
            return None
        expected *= size
    return mem_shape, tuple(perm.index(i) for i in range(len(shape)))


def _rebuild(root: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    shape, inverse = geometry
    return root.view(shape).permute(inverse)


def _grad_buffers(
    dq: torch.Tensor, dk: torch.Tensor, promised: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, out_q, out_k): the root gradients made contiguous (the root's layout, so q's and
    k's strides apply to them) and the buffers the rotated gradients go to.

    A gradient is overwritten only when nothing else can read it: when it is a copy made here
    (from a non-contiguous or expanded gradient, e.g. `.sum()`'s), or when the caller promised
    it (`inplace_backward`) and dq and dk do not share memory (`q_out + k_out` hands both the
    same tensor). Never under create_graph (grad mode on in a backward), where they may be saved.
    """
    copied_q, copied_k = not dq.is_contiguous(), not dk.is_contiguous()
    if copied_q:
        dq = dq.contiguous()
    if copied_k:
        dk = dk.contiguous()
    if torch.is_grad_enabled():
        return dq, dk, torch.empty_like(dq), torch.empty_like(dk)
    promised = promised and dq.untyped_storage().data_ptr() != dk.untyped_storage().data_ptr()
    out_q = dq if copied_q or promised else torch.empty_like(dq)
    out_k = dk if copied_k or promised else torch.empty_like(dk)
    return dq, dk, out_q, out_k


class _RoPEFunction(torch.autograd.Function):
    """q and k through their roots (see `_root`): one launch forward, one backward.

    Working on the roots, which are not views, lets autograd accept an in-place Function with
    two outputs, and spares the gradient copies autograd adds around in-place updates of views.
    The launches take the roots' pointers with the caller's q and k strides (`plan.launch`);
    the root gradients, made contiguous, have the roots' layout, so the same launch serves.
    """

    @staticmethod
    def forward(ctx, q_root, k_root, rest):  # type: ignore[override]
        """rest = (cos, sin, position_ids, plan, promised): one argument, as each argument of
        `apply` costs host time; saved all the same (in-place changes are still caught)."""
        cos, sin, position_ids, plan, promised = rest
        _run(plan.launch, False, q_root, q_root, k_root, k_root, cos, sin, position_ids)
        ctx.mark_dirty(q_root, k_root)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.plan, ctx.promised = plan, promised
        return q_root, k_root

    @staticmethod
    def backward(ctx, dq_root, dk_root):  # type: ignore[override]
        """d(input) = d(output) rotated by -sin (module docstring), one launch for dq and dk,
        written over the incoming gradients when `_grad_buffers` allows it."""
        cos, sin, position_ids = ctx.saved_tensors
        dq, dk, out_q, out_k = _grad_buffers(dq_root, dk_root, ctx.promised)
        _run(ctx.plan.launch, True, dq, out_q, dk, out_k, cos, sin, position_ids)
        return out_q, out_k, None


def _rotate_grad(grad: torch.Tensor, ctx) -> torch.Tensor:
    """General path: d(input) of one tensor, over the gradient when it is a dense copy made here
    (dq and dk reach two Functions here, so whether they alias cannot be checked), else into a
    fresh buffer laid out like the gradient."""
    cos, sin, position_ids = ctx.saved_tensors
    in_place = False
    if not layout_dense(grad.shape, grad.stride()):
        grad = grad.contiguous()  # e.g. the stride-0 gradient of `.sum()`
        in_place = not torch.is_grad_enabled()
    out = grad if in_place else torch.empty_strided(
        grad.shape, grad.stride(), dtype=grad.dtype, device=grad.device)
    launch = _launch(grad.shape, grad.stride(), 0, None, ctx.plan.tables, ctx.plan.has_pos)
    _run(launch, True, grad, out, grad, grad, cos, sin, position_ids)
    return out


class _RoPEQKFunction(torch.autograd.Function):
    """General path (q or k is a partial view, e.g. of a fused QKV output): rotates q AND k in
    one launch, but to autograd it is the in-place update of q only. Autograd refuses a
    Function that updates a view in place and returns two tensors, so `_RoPEKFunction`, applied
    right after, marks the already-rotated k dirty and owns its gradient (two backward launches,
    plus the copies autograd makes around in-place updates of views)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, plan):  # type: ignore[override]
        _run(plan.launch, False, q, q, k, k, cos, sin, position_ids)
        ctx.mark_dirty(q)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.plan = plan
        return q

    @staticmethod
    def backward(ctx, dq):  # type: ignore[override]
        return _rotate_grad(dq, ctx), None, None, None, None, None


class _RoPEKFunction(torch.autograd.Function):
    """Records for autograd the in-place rotation of k done by `_RoPEQKFunction`'s launch."""

    @staticmethod
    def forward(ctx, k, cos, sin, position_ids, plan):  # type: ignore[override]
        ctx.mark_dirty(k)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.plan = plan
        return k

    @staticmethod
    def backward(ctx, dk):  # type: ignore[override]
        return _rotate_grad(dk, ctx), None, None, None, None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch rotary embedding in HF's form (`q * cos + rotate_half(q) * sin`), written
    back into q and k with `copy_` so autograd records the in-place update."""
    if position_ids is not None:
        if cos.dim() == 3 and cos.shape[0] == 1:
            cos, sin = cos[0], sin[0]
        cos, sin = cos[position_ids], sin[position_ids]  # (batch, seq, head_dim)
    elif cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    q_rot = (q * cos) + (_rotate_half(q) * sin)
    k_rot = (k * cos) + (_rotate_half(k) * sin)
    return q.copy_(q_rot), k.copy_(k_rot)


def rope_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    position_ids: torch.Tensor | None = None, *, inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary embeddings to q and k IN PLACE and return them.

    q (batch, heads_q, seq, head_dim), k (batch, heads_k, seq, head_dim): any strides, GQA allowed.
    cos, sin: (batch or 1, seq, head_dim) as HF's rotary embedding returns them, or, with
    position_ids (batch or 1, seq), tables (max_pos, head_dim) indexed by those ids (ids may
    restart inside packed rows; they must be < max_pos, which is not checked to avoid a sync).
    Gradients flow to q and k (rotation by -sin), none to cos/sin (buffers). Use the returned
    tensors: with grad enabled they may be new views of q's and k's memory (see `_root`).

    inplace_backward=True lets the backward rotate the incoming gradients of the returned q and k
    in place (two q/k-sized buffers saved, same traffic). Only where nothing else reads those
    gradients, as when q and k go straight into attention (SDPA and flash-attention return fresh
    dq, dk); not when the caller holds them (`grad_outputs`, `.backward(gradient)`, hooks,
    `retain_grad()`) or the outputs also feed an op that passes its gradient on unchanged
    (`q + x`). Gradients that share memory (from `q + k`) are detected and kept. It applies when
    q and k are whole views of their storage (HF's layout); it is ignored on the Torch path.
    """
    plan = _plan_of(q, k, cos, sin, position_ids)
    if not use_triton(q, k, cos, sin):
        return rope_reference_(q, k, cos, sin, position_ids)
    if plan.copy_tables:
        # One stride set serves both tables; they are small, a copy costs nothing.
        cos, sin = cos.contiguous(), sin.contiguous()
        plan = _plan_of(q, k, cos, sin, position_ids)  # with the copies' strides
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        _run(plan.launch, False, q, q, k, k, cos, sin, position_ids)
        torch.autograd.graph.increment_version((q, k))  # as any in-place op would
        return q, k
    return _apply(q, k, cos, sin, position_ids, plan, inplace_backward)


def _plan_of(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor | None
) -> _Plan:
    return _plan(q.shape, q.stride(), k.shape, k.stride(), cos.shape, cos.stride(), sin.shape,
                 sin.stride(), None if pos is None else pos.shape, None if pos is None else pos.stride())


def _apply(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    position_ids: torch.Tensor | None, plan: _Plan, inplace_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_ under autograd: one Function on the roots of q and k when both are whole views of
    their own storage (HF's layout), else the general pair of Functions."""
    for t in (q, k):
        # Checked before the launch writes them (autograd would only refuse afterwards).
        base = t if t._base is None else t._base
        if base.is_leaf and base.requires_grad:
            raise RuntimeError(
                "rope_ writes q and k in place: they must not be a leaf (or a view of a leaf) that requires grad"
            )
    q_root, k_root = _root(q), _root(k)
    if q_root is not None and k_root is not None and q_root[0] is not k_root[0]:
        rest = (cos, sin, position_ids, plan, inplace_backward)
        q_out, k_out = _RoPEFunction.apply(q_root[0], k_root[0], rest)
        return _rebuild(q_out, q_root[1]), _rebuild(k_out, k_root[1])
    q = _RoPEQKFunction.apply(q, k, cos, sin, position_ids, plan)
    k = _RoPEKFunction.apply(k, cos, sin, position_ids, plan)
    return q, k
