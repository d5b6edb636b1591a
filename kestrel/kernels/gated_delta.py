"""Qwen3.5's chunked gated delta rule, trainable on flash-linear-attention's kernels where its own
backward refuses the GPU.

flash-linear-attention 0.6 raises in its backward on Hopper GPUs under Triton 3.4 to 3.7.0: one
backward kernel, the one that gives each chunk's dq, dk, dw and dg, is miscompiled there (a
transpose of a matrix-product result; fla issue 640) and would return wrong gradients. Every other
stage of its forward and backward runs correctly there. `chunk_gated_delta_rule` here is its
chunked function with that one stage done one of two ways (DQKWG):
- "kernel": flash-linear-attention's own kernel for the stage, launched here only with the key tile
  it is right at there (`chunk_dqkwg_kernel`; key widths above 64, as Qwen3.5's 128);
- "torch": batched PyTorch products over the chunks (`chunk_dqkwg`), a way that depends on no
  Triton code generation. The stage has no sequential dependency, since each chunk reads the state
  h_c and the state gradient the earlier stages computed, so even this costs a few batched
  products per layer instead of the whole sequential reference.

Notation (per batch row and head; chunk c of BT rows; h_c the (K, V) state before chunk c; g the
within-chunk cumulative log-gate, in base-2 units as flash-linear-attention keeps it, g2 = g / ln 2):

    v_new = u - w h_c                                          the corrected values
    o     = s (q * 2^g2) h_c + s [(q k^T) * 2^(g2_i - g2_j) * (i >= j)] v_new
    h_c+1 = 2^g2_last h_c + (k * 2^(g2_last - g2))^T v_new

with s = dk^-1/2. flash-linear-attention's own stages supply the rest; this module's import of
them is deferred so that the package stays optional.
"""

from __future__ import annotations

import contextlib
import functools
import math
from types import SimpleNamespace
from typing import Any, Callable

import torch

CHUNK = 64  # flash-linear-attention's chunk size: its stages and this one must agree
WORKING_BYTES = 256 << 20  # fp32 working memory of `chunk_dqkwg` at once: heads are taken in groups that fit


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _chunks(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, N, CHUNK, D), at least fp32, zero-padded to N chunks."""
    b, t, h, d = x.shape
    x = torch.nn.functional.pad(_wide(x), (0, 0, 0, 0, 0, n * CHUNK - t))
    return x.view(b, n, CHUNK, h, d).permute(0, 3, 1, 2, 4)


def _unchunk(x: torch.Tensor, t: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, N, CHUNK, D) -> (B, T, H, D)."""
    b, h, n, c, d = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, d)[:, :t].to(dtype)


def chunk_dqkwg(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, w: torch.Tensor, g: torch.Tensor,
                h: torch.Tensor, dv: torch.Tensor, do: torch.Tensor, dh: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each chunk's gradients with respect to q, k, w and the cumulative gate, given the state
    gradients: the stage flash-linear-attention's `chunk_bwd_dqkwg` computes.

    q, k, w (B, T, H, K); v_new, dv, do (B, T, H, V); g (B, T, H) fp32 within-chunk cumulative
    log-gate in base 2; h, dh (B, N, H, K, V): the state before chunk c and the gradient of the
    state after it; dv is the total gradient of v_new. Returns dq, dk, dw in q's dtype and dg
    (B, T, H) fp32, the gradient of the natural-log cumulative gate (its reverse cumulative sum
    within each chunk is left to the caller, as flash-linear-attention does). With
    e_ij = 2^(g2_i - g2_j) for i >= j inside a chunk and 0 elsewhere, L the last valid row:

        ds = s (do v_new^T) * e                                   (CHUNK, CHUNK)
        dq = s 2^g2 * (do h_c^T) + ds k
        dk = 2^(g2_L - g2) * (v_new dh_c^T) + ds^T q
        dw = -dv h_c^T
        dg_i = <dq_i, q_i> - <dk_i, k_i>   (+ 2^g2_L <h_c, dh_c> + <k, 2^(g2_L - g2) * (v_new dh_c^T)> at i = L)

    The gate's terms follow from d 2^(g2_a - g2_b) / d g_a = 2^(g2_a - g2_b) (the ln 2 of base 2
    cancels against g2 = g / ln 2): every product that carries a gate factor contributes its
    value times the gradient of its result, to the row that the factor's exponent adds, minus to
    the row that it subtracts; row L of a chunk carries the state's decay.

    The products run in fp32 over a few heads at a time, so the transient memory stays near
    WORKING_BYTES whatever the length and head count.
    """
    b, t, heads, d_k = q.shape
    n, d_v = math.ceil(t / CHUNK), v_new.shape[-1]
    per_head = 4 * n * (CHUNK * 4 * (d_k + d_v) + 2 * d_k * d_v + 3 * CHUNK * CHUNK)  # fp32 bytes alive at once
    step = max(1, WORKING_BYTES // per_head)
    dq, dk, dw = torch.empty_like(q), torch.empty_like(k), torch.empty_like(w)
    dg = torch.empty(b, t, heads, dtype=torch.promote_types(g.dtype, torch.float32), device=q.device)
    for i in range(0, heads, step):
        sl = slice(i, i + step)
        dq[:, :, sl], dk[:, :, sl], dw[:, :, sl], dg[:, :, sl] = _dqkwg_heads(
            q[:, :, sl], k[:, :, sl], v_new[:, :, sl], w[:, :, sl], g[:, :, sl], h[:, :, sl], dv[:, :, sl],
            do[:, :, sl], dh[:, :, sl], scale)
    return dq, dk, dw, dg


def _dqkwg_heads(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, w: torch.Tensor, g: torch.Tensor,
                 h: torch.Tensor, dv: torch.Tensor, do: torch.Tensor, dh: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_dqkwg` for a slice of the heads (same shapes and results)."""
    t = q.shape[1]
    n = math.ceil(t / CHUNK)
    qc, kc, vc, wc, dvc, doc = (_chunks(x, n) for x in (q, k, v_new, w, dv, do))
    gc = _chunks(g.unsqueeze(-1), n).squeeze(-1)  # (B, H, N, CHUNK)
    hs, dhs = (_wide(x).permute(0, 2, 1, 3, 4) for x in (h, dh))  # (B, H, N, K, V)
    rows = torch.arange(n * CHUNK, device=q.device).view(n, CHUNK)
    valid = rows < t  # (N, CHUNK)
    last = (torch.clamp(rows[:, -1], max=t - 1) - rows[:, 0])  # each chunk's last valid row
    g_last = gc.gather(-1, last.view(1, 1, n, 1).expand(*gc.shape[:3], 1))  # (B, H, N, 1)

    causal = (rows[:, :, None] >= rows[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    exponent = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, -math.inf)
    ds = doc @ vc.transpose(-1, -2) * torch.exp2(exponent) * scale  # (B, H, N, CHUNK, CHUNK)
    decay = torch.where(valid, torch.exp2(g_last - gc), 0.0)  # (B, H, N, CHUNK)
    dk_state = (vc @ dhs.transpose(-1, -2)) * decay[..., None]
    dq = (doc @ hs.transpose(-1, -2)) * (torch.exp2(gc) * scale)[..., None] + ds @ kc
    dk = dk_state + ds.transpose(-1, -2) @ qc
    dw = -(dvc @ hs.transpose(-1, -2))
    dg_last = (hs * dhs).sum((-1, -2)) * torch.exp2(g_last[..., 0]) + (dk_state * kc).sum((-1, -2))  # (B, H, N)
    dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)
    dg = dg.scatter_add(-1, last.view(1, 1, n, 1).expand(*dg.shape[:3], 1), dg_last[..., None])
    dg = dg.permute(0, 2, 3, 1).reshape(q.shape[0], n * CHUNK, -1)[:, :t]
    return _unchunk(dq, t, q.dtype), _unchunk(dk, t, k.dtype), _unchunk(dw, t, w.dtype), dg


CLEAN_KEY_TILE = 128  # the one key-tile width at which the stage's kernel is right on Hopper under Triton 3.4-3.7.0


class TileRefused(RuntimeError):
    """The stage's kernel would need a key tile it is not right at: the PyTorch way serves."""


def _dqkwg_tiles(q: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """(BK, BV): the stage's kernel tiles for keys q (.., K) and values v (.., V), each the key or
    value width rounded up to a power of two, at most CLEAN_KEY_TILE. Under Triton 3.4-3.7.0 on
    Hopper the kernel gives wrong dq and dk at key tiles of 64 (flash-linear-attention issue 640)
    and of 32 in bf16 (bench/RESULTS.md, session 31); at 128 it gave HF's reference's gradients
    in every case measured. This launcher runs only where flash-linear-attention refuses its own
    backward, so it launches only a key tile of CLEAN_KEY_TILE (key widths above 64, on a device
    whose shared memory holds it) and raises otherwise: `linear_attention.stand_in_way`'s probe
    then takes the PyTorch way. The probe also checks a 128-wide launch at the layer's own head
    shape before any training step takes it."""
    from fla.utils import check_shared_mem

    bk, bv = (min(max(1 << (x.shape[-1] - 1).bit_length(), 16), CLEAN_KEY_TILE) for x in (q, v))
    if bk != CLEAN_KEY_TILE or not check_shared_mem("hopper", q.device.index or 0):
        raise TileRefused(f"the stage's kernel runs only with a key tile of {CLEAN_KEY_TILE} here "
                           f"(keys {q.shape[-1]} wide, a tile of {bk})")
    return bk, bv


def chunk_dqkwg_kernel(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, w: torch.Tensor, g: torch.Tensor,
                       h: torch.Tensor, dv: torch.Tensor, do: torch.Tensor, dh: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_dqkwg` (same arguments, shapes and results) on flash-linear-attention's own Triton
    kernel for the stage, launched here only with the key tile it is right at (`_dqkwg_tiles`).
    The kernel gives each (key tile, chunk, batch row x head) program its tile of dq, dk, dw and a
    partial dg over its key columns; the partials are summed over the key tiles."""
    from fla.ops.common.chunk_o import chunk_bwd_kernel_dqkwg

    b, t, heads, d_k = k.shape
    d_v = v_new.shape[-1]
    bk, bv = _dqkwg_tiles(q, v_new)
    n_k, n_t = math.ceil(d_k / bk), math.ceil(t / CHUNK)
    dq, dk, dw = torch.empty_like(q), torch.empty_like(k), torch.empty_like(w)
    dg = torch.empty(n_k, *g.shape, dtype=torch.float32, device=g.device)
    chunk_bwd_kernel_dqkwg[(n_k * n_t, b * heads)](
        q=q, k=k, v=v_new, g=g, g_gamma=None, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=dw, dv=dv, dg=dg,
        cu_seqlens=None, chunk_indices=None, scale=scale, B=b, T=t, H=heads, HV=heads, K=d_k, V=d_v,
        BT=CHUNK, BK=bk, BV=bv, STATE_V_FIRST=False)
    return dq, dk, dw, dg.sum(0)


DQKWG = {"kernel": chunk_dqkwg_kernel, "torch": chunk_dqkwg}  # the stage's ways, fastest first


@functools.cache
def _fla() -> SimpleNamespace:
    """flash-linear-attention 0.6's stages (ImportError or AttributeError when absent or moved)."""
    from fla.modules.norm import l2norm as norm
    from fla.ops.common import chunk_delta_h, chunk_o
    from fla.ops.gated_delta_rule import chunk, wy_fast
    from fla.ops.utils import chunk_local_cumsum

    return SimpleNamespace(
        l2norm_fwd=norm.l2norm_fwd, l2norm_bwd=norm.l2norm_bwd, forward=chunk.chunk_gated_delta_rule_fwd,
        recompute_w_u=wy_fast.recompute_w_u_fwd, states=chunk_delta_h.chunk_gated_delta_rule_fwd_h,
        dv_local=chunk_o.chunk_bwd_dv_local, state_grads=chunk_delta_h.chunk_gated_delta_rule_bwd_dhu,
        wy_bwd=wy_fast.prepare_wy_repr_bwd, cumsum=chunk_local_cumsum)


class _GatedDeltaRule(torch.autograd.Function):
    """flash-linear-attention's chunked gated delta rule (q, k L2-normalised in it), its backward
    with one of DQKWG's ways in place of the stage that Hopper under Triton 3.4-3.7.0 miscompiles."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None, keep_state: bool,
                dqkwg: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        fla = _fla()
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        scale = q.shape[-1] ** -0.5
        qn, q_rstd = fla.l2norm_fwd(q)
        kn, k_rstd = fla.l2norm_fwd(k)
        g_cum, o, a, final, initial_state, _ = fla.forward(
            q=qn, k=kn, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=keep_state, chunk_size=CHUNK)
        ctx.save_for_backward(qn, q_rstd, kn, k_rstd, v, g_cum, beta, a, initial_state)
        ctx.scale, ctx.dtypes, ctx.dqkwg = scale, (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype), DQKWG[dqkwg]
        return o.to(q.dtype), final

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, dht: torch.Tensor | None) -> tuple[Any, ...]:
        with _on_device(do):
            return _GatedDeltaRule._backward(ctx, do, dht)

    @staticmethod
    def _backward(ctx: Any, do: torch.Tensor, dht: torch.Tensor | None) -> tuple[Any, ...]:
        fla = _fla()
        q, q_rstd, k, k_rstd, v, g, beta, a, initial_state = ctx.saved_tensors
        do, scale = do.contiguous(), ctx.scale
        w, u = fla.recompute_w_u(k=k, v=v, beta=beta, A=a, g=g)
        h, v_new, _ = fla.states(k=k, w=w, u=u, g=g, initial_state=initial_state, output_final_state=False,
                                 chunk_size=CHUNK)
        del u
        dv = fla.dv_local(q=q, k=k, g=g, do=do, scale=scale, chunk_size=CHUNK)
        dh, dh0, dv = fla.state_grads(q=q, k=k, w=w, g=g, h0=initial_state, dht=dht, do=do, dv=dv, scale=scale,
                                      chunk_size=CHUNK)
        dq, dk, dw, dg = ctx.dqkwg(q, k, v_new, w, g, h, dv, do, dh, scale)
        # The whole run's memory peak fell in this backward (Qwen3.5-9B, bench/RESULTS.md, session 35):
        # the states and their gradients go as soon as their last reader has run, not at return.
        del w, h, v_new, dh
        dk2, dv, db, dg2 = fla.wy_bwd(k=k, v=v, beta=beta, g=g, A=a, dw=dw, du=dv)
        del dw
        dg = fla.cumsum(dg + dg2, chunk_size=CHUNK, reverse=True)
        dq = fla.l2norm_bwd(q, q_rstd, dq)
        # One rounding of the fp32 sum, as `(dk.float() + dk2.float()).to(dk.dtype)` gives, without its
        # two fp32 copies: a bf16 add computes in fp32 and rounds once.
        dk = fla.l2norm_bwd(k, k_rstd, torch.add(dk, dk2).to(dk.dtype))
        tq, tk, tv, tg, tb = ctx.dtypes
        return dq.to(tq), dk.to(tk), dv.to(tv), dg.to(tg), db.to(tb), dh0, None, None


def _on_device(x: torch.Tensor) -> Any:
    """The tensor's device made current: the stages launch on the current device."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = True,
                           dqkwg: str = "kernel") -> tuple[torch.Tensor, torch.Tensor | None]:
    """flash-linear-attention's `chunk_gated_delta_rule` call (q, k (B, T, H, K); v (B, T, H, V);
    g, beta (B, T, H); natural-log gate per token) -> (output (B, T, H, V), final state or None),
    trainable where its own backward refuses the device. q and k are always L2-normalised in it,
    as Qwen3.5 asks. `dqkwg` names the way the refused stage runs (a key of DQKWG)."""
    if not use_qk_l2norm_in_kernel:
        raise ValueError("chunk_gated_delta_rule normalises q and k itself (Qwen3.5's layers ask for that)")
    if dqkwg not in DQKWG:
        raise ValueError(f"dqkwg must be one of {', '.join(DQKWG)}, not {dqkwg!r}")
    with _on_device(q):
        return _GatedDeltaRule.apply(q, k, v, g, beta, initial_state, output_final_state, dqkwg)


OUTPUTS = ("output", "dq", "dk", "dv", "dg", "dbeta")  # what `forward_backward` returns, in order


def forward_backward(fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """One forward and backward of a chunked gated-delta-rule function `fn` (this module's, flash-
    linear-attention's or HF's: the same call) on fresh leaves in `dtype` (g stays fp32, as the
    layers pass it) with output gradient `grad`: [output, dq, dk, dv, dg, dbeta] in fp32."""
    # copies, so that a call in the inputs' own dtype does not turn the caller's tensors into leaves
    xs = [x.detach().to(dt, copy=True).requires_grad_()
          for x, dt in zip((q, k, v, g, beta), (dtype, dtype, dtype, torch.float32, dtype))]
    out, _ = fn(xs[0], xs[1], xs[2], g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=True)
    out.backward(grad.to(out.dtype))
    return [out.detach().float()] + [x.grad.float() for x in xs]


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    """||a - b|| / ||b|| for each pair."""
    return [float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(got, want)]


def available() -> bool:
    """Whether flash-linear-attention's stages this module composes can be imported."""
    try:
        _fla()
    except (ImportError, AttributeError):
        return False
    return True
