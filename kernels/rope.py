"""Rotary position embedding applied to q and k in place, in one launch (HF `rotate_half` form).

With x = [x1, x2] split at half = head_dim / 2, and cos = [c1, c2], sin = [s1, s2] likewise:

    forward:   y1 = x1 * c1 - x2 * s1        y2 = x2 * c2 + x1 * s2
    backward:  dx1 = dy1 * c1 + dy2 * s2     dx2 = dy2 * c2 - dy1 * s1

The backward is the transpose of the forward (for HF's tables, where c1 == c2 and s1 == s2, a
rotation by -sin). It writes a fresh gradient buffer (see `_rotate_grad` for why not in place).

Layout: q (batch, heads_q, seq, head_dim), k (batch, heads_k, seq, head_dim), any strides (HF
hands in transposed views of (batch, seq, heads, head_dim)); nothing is copied. The grid is one
program per (batch, seq) token, which rotates every head of q and of k for that token, so the
cos/sin row is read once. All offsets are int64. The backward is one launch too, except when q
or k is a partial view of its storage (see `_RoPEQKFunction`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._utils import non_overlapping
from kernels.dispatch import use_triton


@triton.jit
def _rotate_heads(
    X, OUT, sh, sd, n_heads, half, c1, c2, s1, s2,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # X and OUT point at head 0, dim 0 of one token and share strides (OUT is X in the forward);
    # the (BLOCK_H, BLOCK_D) tile covers both halves of every head.
    heads = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    dims = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    mask = (heads < n_heads) & (dims < half)
    lo = heads * sh + dims * sd
    hi = lo + half * sd
    x1 = tl.load(X + lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + hi, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(OUT + lo, y1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + hi, y2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, OQ, q_sb, q_sh, q_ss, q_sd,
    K, OK, k_sb, k_sh, k_ss, k_sd,
    COS, SIN, cs_sb, cs_ss, cs_sd, POS, pos_sb, pos_ss,
    seq_len, n_heads_q, n_heads_k, half,
    HAS_POS: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (batch * seq,). Reads Q/K, writes OQ/OK (the same tensors in the forward).
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    s = pid % seq_len
    if HAS_POS:
        # cos/sin are (max_pos, head_dim) tables; the row is this token's position id.
        cs_row = tl.load(POS + b * pos_sb + s * pos_ss).to(tl.int64) * cs_ss
    else:
        # cos/sin are (batch or 1, seq, head_dim); cs_sb is 0 when shared over the batch.
        cs_row = b * cs_sb + s * cs_ss
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    dmask = dims < half
    c1 = tl.load(COS + cs_row + dims * cs_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(COS + cs_row + (dims + half) * cs_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(SIN + cs_row + dims * cs_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(SIN + cs_row + (dims + half) * cs_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    q_tok = b * q_sb + s * q_ss
    _rotate_heads(Q + q_tok, OQ + q_tok, q_sh, q_sd, n_heads_q, half, c1, c2, s1, s2,
                  BACKWARD, BLOCK_HQ, BLOCK_D)
    k_tok = b * k_sb + s * k_ss
    _rotate_heads(K + k_tok, OK + k_tok, k_sh, k_sd, n_heads_k, half, c1, c2, s1, s2,
                  BACKWARD, BLOCK_HK, BLOCK_D)


def _tables(
    q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Validate cos/sin against q and return them as 3-D (1 or batch, rows, head_dim) with the
    batch stride to use (0 when one table serves the whole batch, or when position ids index)."""
    batch, _, seq, head_dim = q.shape
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if position_ids is not None:
        if cos.dim() == 3 and cos.shape[0] == 1:
            cos, sin = cos[0], sin[0]
        if cos.dim() != 2 or cos.shape[1] != head_dim:
            raise ValueError(f"with position_ids, cos/sin must be (max_pos, {head_dim}), got "
                             f"{tuple(cos.shape)}")
        if position_ids.dim() != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, batch):
            raise ValueError(f"position_ids must be ({batch} or 1, {seq}), got {tuple(position_ids.shape)}")
        return cos[None], sin[None], 0
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.dim() != 3 or cos.shape[1:] != (seq, head_dim) or cos.shape[0] not in (1, batch):
        raise ValueError(f"cos/sin must be ({batch} or 1, {seq}, {head_dim}), got {tuple(cos.shape)}")
    return cos, sin, (cos.stride(0) if cos.shape[0] > 1 else 0)


def rope_launch(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    position_ids: torch.Tensor | None, backward: bool = False,
    out_q: torch.Tensor | None = None, out_k: torch.Tensor | None = None,
) -> None:
    """Rotate q and k (k may be None) in one launch; backward=True rotates the other way.

    Writes in place unless out_q / out_k are given, which must have their input's strides.
    Shapes as in `rope_`.
    """
    batch, n_heads_q, seq, head_dim = q.shape
    if k is not None and (k.shape[0] != batch or k.shape[2:] != q.shape[2:]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch/seq/head_dim")
    out_q = q if out_q is None else out_q
    n_heads_k = 0 if k is None else k.shape[1]
    k = q if k is None else k  # with n_heads_k = 0 every access to it is masked off
    out_k = k if out_k is None else out_k
    if out_q.stride() != q.stride() or out_k.stride() != k.stride():
        raise ValueError("output buffers must share their input's strides")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        # One stride set serves both tables; they are small, a copy costs nothing.
        cos, sin = cos.contiguous(), sin.contiguous()
    cos3, sin3, cs_sb = _tables(q, cos, sin, position_ids)
    if batch * seq == 0:
        return
    pos = position_ids if position_ids is not None else cos3  # placeholder when unused
    pos_sb = pos.stride(0) if position_ids is not None and pos.shape[0] > 1 else 0
    pos_ss = pos.stride(1) if position_ids is not None else 0
    block_d = triton.next_power_of_2(head_dim // 2)
    block_hq = triton.next_power_of_2(n_heads_q)
    block_hk = triton.next_power_of_2(max(n_heads_k, 1))
    warps = 8 if max(block_hq, block_hk) * block_d >= 2048 else 4
    _rope_kernel[(batch * seq,)](
        q, out_q, *q.stride(), k, out_k, *k.stride(),
        cos3, sin3, cs_sb, cos3.stride(1), cos3.stride(2), pos, pos_sb, pos_ss,
        seq, n_heads_q, n_heads_k, head_dim // 2,
        HAS_POS=position_ids is not None, BACKWARD=backward,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, num_warps=warps,
    )


Geometry = tuple[tuple[int, ...], tuple[int, ...]]  # (shape in memory order, inverse permutation)


def _root(t: torch.Tensor) -> tuple[torch.Tensor, Geometry] | None:
    """The non-view tensor that `t` covers exactly, and how to rebuild `t` from it with `view` +
    `permute` (whose backward passes are free). None when `t` covers only part of its storage
    (a slice of a fused QKV projection) or its root is not contiguous.

    HF's q is `linear(x).view(b, s, h, d).transpose(1, 2)`: the root is the linear's output.
    """
    root = t if t._base is None else t._base
    if root.requires_grad != t.requires_grad:
        # t is a view made inside an autograd Function: its gradient flows through t's own node,
        # not through `_base`, so the root must not be used.
        return None
    if not root.is_contiguous() or (root.numel(), root.storage_offset()) != (t.numel(), t.storage_offset()):
        return None
    perm = sorted(range(t.dim()), key=lambda i: t.stride(i), reverse=True)
    geometry = (tuple(t.shape[i] for i in perm), tuple(perm.index(i) for i in range(t.dim())))
    rebuilt = _rebuild(root, geometry)
    if any(rebuilt.stride(i) != t.stride(i) for i in range(t.dim()) if t.shape[i] > 1):
        return None
    return root, geometry


def _rebuild(root: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    shape, inverse = geometry
    return root.view(shape).permute(inverse)


class _RoPEFunction(torch.autograd.Function):
    """q and k through their roots (see `_root`): one launch forward, one backward.

    Working on the roots, which are not views, lets autograd accept an in-place Function with
    two outputs, and spares the gradient copies autograd adds around in-place updates of views.
    """

    @staticmethod
    def forward(ctx, q_root, k_root, q_geometry, k_geometry, cos, sin, position_ids):  # type: ignore[override]
        rope_launch(_rebuild(q_root, q_geometry), _rebuild(k_root, k_geometry), cos, sin, position_ids)
        ctx.mark_dirty(q_root, k_root)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.geometries = (q_geometry, k_geometry)
        return q_root, k_root

    @staticmethod
    def backward(ctx, dq_root, dk_root):  # type: ignore[override]
        """d(input) = rotation of d(output) by -sin, written to fresh buffers: autograd may hand
        one gradient tensor to several readers (`q_out + k_out` gives both the same), so
        rotating it in place could corrupt another's gradient. Same traffic either way."""
        cos, sin, position_ids = ctx.saved_tensors
        q_geometry, k_geometry = ctx.geometries
        dq_root, dk_root = dq_root.contiguous(), dk_root.contiguous()  # stride-0 grads of `.sum()`
        out_q, out_k = torch.empty_like(dq_root), torch.empty_like(dk_root)
        rope_launch(
            _rebuild(dq_root, q_geometry), _rebuild(dk_root, k_geometry), cos, sin, position_ids,
            backward=True, out_q=_rebuild(out_q, q_geometry), out_k=_rebuild(out_k, k_geometry),
        )
        return out_q, out_k, None, None, None, None, None


def _rotate_grad(grad: torch.Tensor, ctx) -> torch.Tensor:
    """General path: d(input) of one tensor into a fresh buffer laid out like the gradient."""
    if not _is_dense(grad):
        grad = grad.contiguous()  # e.g. the stride-0 gradient of `.sum()`
    out = torch.empty_strided(grad.shape, grad.stride(), dtype=grad.dtype, device=grad.device)
    cos, sin, position_ids = ctx.saved_tensors
    rope_launch(grad, None, cos, sin, position_ids, backward=True, out_q=out)
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
    def forward(ctx, q, k, cos, sin, position_ids):  # type: ignore[override]
        rope_launch(q, k, cos, sin, position_ids)
        ctx.mark_dirty(q)
        ctx.save_for_backward(cos, sin, position_ids)
        return q

    @staticmethod
    def backward(ctx, dq):  # type: ignore[override]
        return _rotate_grad(dq, ctx), None, None, None, None


class _RoPEKFunction(torch.autograd.Function):
    """Records for autograd the in-place rotation of k done by `_RoPEQKFunction`'s launch."""

    @staticmethod
    def forward(ctx, k, cos, sin, position_ids):  # type: ignore[override]
        ctx.mark_dirty(k)
        ctx.save_for_backward(cos, sin, position_ids)
        return k

    @staticmethod
    def backward(ctx, dk):  # type: ignore[override]
        return _rotate_grad(dk, ctx), None, None, None


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
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary embeddings to q and k IN PLACE and return them.

    q (batch, heads_q, seq, head_dim), k (batch, heads_k, seq, head_dim): any strides, GQA allowed.
    cos, sin: (batch or 1, seq, head_dim) as HF's rotary embedding returns them, or, with
    position_ids (batch or 1, seq), tables (max_pos, head_dim) indexed by those ids (ids may
    restart inside packed rows; they must be < max_pos, which is not checked to avoid a sync).
    Gradients flow to q and k (rotation by -sin), none to cos/sin (buffers). Use the returned
    tensors: with grad enabled they may be new views of q's and k's memory (see `_root`).
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D (batch, heads, seq, head_dim), got {q.dim()}-D/{k.dim()}-D")
    if not (non_overlapping(q) and non_overlapping(k)):
        raise ValueError("q and k are written in place and must not have overlapping elements")
    _tables(q, cos, sin, position_ids)  # shape checks, for both paths
    if not use_triton(q, k, cos, sin):
        return rope_reference_(q, k, cos, sin, position_ids)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        rope_launch(q, k, cos, sin, position_ids)
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
        q_out, k_out = _RoPEFunction.apply(
            q_root[0], k_root[0], q_root[1], k_root[1], cos, sin, position_ids
        )
        return _rebuild(q_out, q_root[1]), _rebuild(k_out, k_root[1])
    q = _RoPEQKFunction.apply(q, k, cos, sin, position_ids)
    k = _RoPEKFunction.apply(k, cos, sin, position_ids)
    return q, k
