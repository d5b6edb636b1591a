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
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._utils import non_overlapping
from kernels.dispatch import use_triton

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
    Q, OQ, q_sb, q_sh, q_ss, q_sd,
    K, OK, k_sb, k_sh, k_ss, k_sd,
    COS, SIN, cs_sb, cs_ss, cs_sd, POS, pos_sb, pos_ss,
    seq_len,
    HEADS_Q: tl.constexpr, HEADS_K: tl.constexpr, HALF: tl.constexpr, TOKENS: tl.constexpr,
    HAS_POS: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (batch * cdiv(seq_len, TOKENS),), sequence blocks fastest. Reads Q/K, writes OQ/OK
    # (the same tensors in place). Masked lanes load garbage that only reaches masked stores.
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


class _Tables(NamedTuple):
    """cos/sin as 3-D (1 or batch, rows, head_dim), one stride set, unit last stride; the batch
    stride the kernel uses (0 when one table serves the batch, or when position ids index it);
    the position ids (batch or 1, seq), or None."""

    cos: torch.Tensor
    sin: torch.Tensor
    batch_stride: int
    position_ids: torch.Tensor | None


def _tables(
    q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None
) -> _Tables:
    """Validate cos/sin (and position ids) against q and put them in the kernel's form."""
    batch, _, seq, head_dim = q.shape
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        # One stride set serves both tables; they are small, a copy costs nothing.
        cos, sin = cos.contiguous(), sin.contiguous()
    if position_ids is not None:
        if cos.dim() == 3 and cos.shape[0] == 1:
            cos, sin = cos[0], sin[0]
        if cos.dim() != 2 or cos.shape[1] != head_dim:
            raise ValueError(f"with position_ids, cos/sin must be (max_pos, {head_dim}), got "
                             f"{tuple(cos.shape)}")
        if position_ids.dim() != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, batch):
            raise ValueError(f"position_ids must be ({batch} or 1, {seq}), got {tuple(position_ids.shape)}")
        return _Tables(cos[None], sin[None], 0, position_ids)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.dim() != 3 or cos.shape[1:] != (seq, head_dim) or cos.shape[0] not in (1, batch):
        raise ValueError(f"cos/sin must be ({batch} or 1, {seq}, {head_dim}), got {tuple(cos.shape)}")
    return _Tables(cos, sin, cos.stride(0) if cos.shape[0] > 1 else 0, None)


@functools.lru_cache(maxsize=None)
def _config(seq_block: int, heads_q: int, heads_k: int, head_dim: int) -> dict:
    """Compile-time sizes, TOKENS and num_warps of the kernel (see _TILE). seq_block:
    next_pow2(seq), capped at _TILE, so short sequences get short tiles and the cache stays small."""
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    block_hq = triton.next_power_of_2(heads_q)
    block_hk = triton.next_power_of_2(heads_k) if heads_k else 0
    per_token = 2 * block_d * (block_hq + block_hk)
    tokens = min(1 << (max(1, _TILE // per_token).bit_length() - 1), seq_block)
    warps = 4 if tokens * per_token <= _MAX_ELEMENTS_AT_4_WARPS else 8
    return dict(HEADS_Q=heads_q, HEADS_K=heads_k, HALF=half, TOKENS=tokens, BLOCK_HQ=block_hq,
                BLOCK_HK=max(block_hk, 1), BLOCK_D=block_d, num_warps=warps)


def rope_launch(
    q: torch.Tensor, k: torch.Tensor | None, tables: _Tables, backward: bool = False,
    out_q: torch.Tensor | None = None, out_k: torch.Tensor | None = None,
) -> None:
    """Rotate q and k (k may be None) in one launch; backward=True rotates the other way.

    q (batch, heads_q, seq, head_dim), k (batch, heads_k, seq, head_dim), any strides, checked
    against each other and the tables by the caller. Writes in place unless out_q / out_k are
    given, which must have their input's strides.
    """
    batch, heads_q, seq, head_dim = q.shape
    if batch * seq == 0:
        return
    heads_k = 0 if k is None else k.shape[1]
    config = _config(min(triton.next_power_of_2(seq), _TILE), heads_q, heads_k, head_dim)
    k = q if k is None else k  # with HEADS_K = 0 the kernel never touches it
    out_q = q if out_q is None else out_q
    out_k = k if out_k is None else out_k
    cos, sin, cs_sb, pos = tables
    pos_strides = (0, 0) if pos is None else (pos.stride(0) if pos.shape[0] > 1 else 0, pos.stride(1))
    _rope_kernel[(batch * triton.cdiv(seq, config["TOKENS"]),)](
        q, out_q, *q.stride(), k, out_k, *k.stride(),
        cos, sin, cs_sb, cos.stride(1), cos.stride(2), cos if pos is None else pos, *pos_strides,
        seq, HAS_POS=pos is not None, BACKWARD=backward, **config,
    )


Geometry = tuple[tuple[int, ...], tuple[int, ...]]  # (shape in memory order, inverse permutation)


def _root(t: torch.Tensor) -> tuple[torch.Tensor, Geometry] | None:
    """The non-view tensor that `t` covers exactly, and how to rebuild `t` from it with `view` +
    `permute` (whose backward passes are free). None when `t` covers only part of its storage
    (a slice of a fused QKV projection) or its root is not contiguous.

    HF's q is `linear(x).view(b, s, h, d).transpose(1, 2)`: the root is the linear's output.
    Checked on the strides alone: no view is made here.
    """
    root = t if t._base is None else t._base
    if root.requires_grad != t.requires_grad:
        # t is a view made inside an autograd Function: its gradient flows through t's own node,
        # not through `_base`, so the root must not be used.
        return None
    if not root.is_contiguous() or (root.numel(), root.storage_offset()) != (t.numel(), t.storage_offset()):
        return None
    strides = t.stride()
    perm = sorted(range(t.dim()), key=strides.__getitem__, reverse=True)
    shape = tuple(t.shape[i] for i in perm)
    expected = 1  # `root.view(shape)` is contiguous: walk its strides from the last dimension
    for i, size in zip(reversed(perm), reversed(shape)):
        if size > 1 and strides[i] != expected:
            return None
        expected *= size
    return root, (shape, tuple(perm.index(i) for i in range(t.dim())))


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
    copied = (not dq.is_contiguous(), not dk.is_contiguous())
    dq, dk = dq.contiguous(), dk.contiguous()
    if torch.is_grad_enabled():
        return dq, dk, torch.empty_like(dq), torch.empty_like(dk)
    promised = promised and dq.untyped_storage().data_ptr() != dk.untyped_storage().data_ptr()
    out_q = dq if copied[0] or promised else torch.empty_like(dq)
    out_k = dk if copied[1] or promised else torch.empty_like(dk)
    return dq, dk, out_q, out_k


class _RoPEFunction(torch.autograd.Function):
    """q and k through their roots (see `_root`): one launch forward, one backward.

    Working on the roots, which are not views, lets autograd accept an in-place Function with
    two outputs, and spares the gradient copies autograd adds around in-place updates of views.
    `views` holds the caller's q and k (views of the roots), read for their strides only.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q_root, k_root, views, cos, sin, batch_stride, position_ids, promised
    ):
        q, k = views
        rope_launch(q, k, _Tables(cos, sin, batch_stride, position_ids))
        ctx.mark_dirty(q_root, k_root)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.layouts = ((q.shape, q.stride()), (k.shape, k.stride()))
        ctx.batch_stride, ctx.promised = batch_stride, promised
        return q_root, k_root

    @staticmethod
    def backward(ctx, dq_root, dk_root):  # type: ignore[override]
        """d(input) = d(output) rotated by -sin (module docstring), one launch for dq and dk,
        written over the incoming gradients when `_grad_buffers` allows it."""
        cos, sin, position_ids = ctx.saved_tensors
        (q_shape, q_strides), (k_shape, k_strides) = ctx.layouts
        dq_root, dk_root, out_q, out_k = _grad_buffers(dq_root, dk_root, ctx.promised)
        rope_launch(
            dq_root.as_strided(q_shape, q_strides), dk_root.as_strided(k_shape, k_strides),
            _Tables(cos, sin, ctx.batch_stride, position_ids), backward=True,
            out_q=None if out_q is dq_root else out_q.as_strided(q_shape, q_strides),
            out_k=None if out_k is dk_root else out_k.as_strided(k_shape, k_strides),
        )
        return out_q, out_k, None, None, None, None, None, None


def _rotate_grad(grad: torch.Tensor, ctx) -> torch.Tensor:
    """General path: d(input) of one tensor, over the gradient when it is a dense copy made here
    (dq and dk reach two Functions here, so whether they alias cannot be checked), else into a
    fresh buffer laid out like the gradient."""
    cos, sin, position_ids = ctx.saved_tensors
    tables = _Tables(cos, sin, ctx.batch_stride, position_ids)
    if not _is_dense(grad):
        grad = grad.contiguous()  # e.g. the stride-0 gradient of `.sum()`
        if not torch.is_grad_enabled():
            rope_launch(grad, None, tables, backward=True)
            return grad
    out = torch.empty_strided(grad.shape, grad.stride(), dtype=grad.dtype, device=grad.device)
    rope_launch(grad, None, tables, backward=True, out_q=out)
    return out


def _is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping with no holes, in any dimension order."""
    extent = 1
    for stride, size in sorted((t.stride(i), t.shape[i]) for i in range(t.dim()) if t.shape[i] != 1):
        if stride != extent:
            return False
        extent *= size
    return True


class _RoPEQKFunction(torch.autograd.Function):
    """General path (q or k is a partial view, e.g. of a fused QKV output): rotates q AND k in
    one launch, but to autograd it is the in-place update of q only. Autograd refuses a
    Function that updates a view in place and returns two tensors, so `_RoPEKFunction`, applied
    right after, marks the already-rotated k dirty and owns its gradient (two backward launches,
    plus the copies autograd makes around in-place updates of views)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, batch_stride, position_ids):  # type: ignore[override]
        rope_launch(q, k, _Tables(cos, sin, batch_stride, position_ids))
        ctx.mark_dirty(q)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.batch_stride = batch_stride
        return q

    @staticmethod
    def backward(ctx, dq):  # type: ignore[override]
        return _rotate_grad(dq, ctx), None, None, None, None, None


class _RoPEKFunction(torch.autograd.Function):
    """Records for autograd the in-place rotation of k done by `_RoPEQKFunction`'s launch."""

    @staticmethod
    def forward(ctx, k, cos, sin, batch_stride, position_ids):  # type: ignore[override]
        ctx.mark_dirty(k)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.batch_stride = batch_stride
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
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D (batch, heads, seq, head_dim), got {q.dim()}-D/{k.dim()}-D")
    if k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch/seq/head_dim")
    if not (non_overlapping(q) and non_overlapping(k)):
        raise ValueError("q and k are written in place and must not have overlapping elements")
    tables = _tables(q, cos, sin, position_ids)  # shape checks, for both paths
    if not use_triton(q, k, cos, sin):
        return rope_reference_(q, k, cos, sin, position_ids)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        rope_launch(q, k, tables)
        torch.autograd.graph.increment_version(q)  # as any in-place op would
        torch.autograd.graph.increment_version(k)
        return q, k
    for t in (q, k):
        # Checked before the launch writes them (autograd would only refuse afterwards).
        base = t if t._base is None else t._base
        if base.is_leaf and base.requires_grad:
            raise RuntimeError(
                "rope_ writes q and k in place: they must not be a leaf (or a view of a leaf) that requires grad"
            )
    q_root, k_root = _root(q), _root(k)
    if q_root is not None and k_root is not None and q_root[0] is not k_root[0]:
        q_out, k_out = _RoPEFunction.apply(q_root[0], k_root[0], (q, k), *tables, inplace_backward)
        return _rebuild(q_out, q_root[1]), _rebuild(k_out, k_root[1])
    q = _RoPEQKFunction.apply(q, k, *tables)
    k = _RoPEKFunction.apply(k, *tables)
    return q, k
