"""Fused lm_head + cross-entropy, and per-token log-probs, without ever holding `(N, V)` logits.

Memory argument: hidden is `(N, H)`; full logits would be `(N, V)`, i.e. `V / H` times hidden
(32x for Llama-3: 128256 / 4096, 2.1 GB in bf16 at N = 8192, 4.2 GB in fp32). Tokens are
processed in chunks of `C` rows with `C * V ~= N * H`, so one chunk of logits costs about as much
as hidden itself, and that one `(C, V)` buffer is reused by every chunk (floor: 128 rows, so the
matmuls stay matmuls; 512 when no weight gradient is formed, see `_chunk_size`). At N = 8192,
H = 4096, V = 128256, bf16: C = 256, a 66 MB chunk, and the whole op peaks near 1.18 GB, the
bf16 grads (1.12 GB) included.

Per chunk (rows `s:e`), with `x = h[s:e] @ W^T` in the weight dtype (fp32 accumulation):

    z      = cap(x) / T,        cap(x) = c * tanh(x / c)  (Gemma softcap; identity when None)
    lse    = logsumexp_v z                                 (online, one pass over V in blocks)
    loss_i = lse_i - z[i, y_i]                             (0 where y_i == ignore_index)
    dloss_i / dx[i, v] = (softmax(z)[i, v] - [v == y_i]) * (1 - tanh^2(x / c)) / T

The Triton kernel overwrites the chunk's logits in place with that gradient times a scale, then
    grad_h[s:e] = dx @ W        (C, V) @ (V, H)
    grad_W     += dx^T @ h[s:e] (V, C) @ (C, H)   skipped when W is frozen (LoRA); accumulated
                                                  in W's dtype (an fp32 copy would cost 2 GB);
                                                  the first chunk writes it (no zero fill).

`fused_linear_cross_entropy` ("mean"/"sum") does all of this during forward, with scale
`1 / num_valid` ("mean", a device tensor: no host sync) or 1 ("sum"); backward only multiplies the
saved grads by the scalar grad_output, and on the GPU skips that pass over grad_W (2.1 GB of
traffic) when grad_output is 1, deciding on the device (no host sync, graph-safe). "none" and
`chunked_token_logprobs` get a per-token grad_output g. With W frozen (LoRA's head) only grad_h
is wanted, and its row i is g_i times the row computed for g = 1, so forward forms those unit
rows (`(N, H)`, hidden's size, saved instead of hidden) and backward scales each by g_i: no
chunk logits are recomputed. When W needs a gradient, g must weight each row *before* the sum
over tokens in grad_W, so forward saves only `lse` `(N,)` and backward recomputes the chunk
logits (one extra matmul per chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kestrel.kernels._launch import launch
from kestrel.kernels._utils import cdiv, sm_count
from kestrel.kernels.dispatch import use_triton

# Vocabulary is swept in blocks of at most this many columns (tests lower it to force the loop):
# at 128K vocabulary, wide blocks on 32 warps beat narrower ones (bench/ce_variants.py;
# bench/RESULTS.md, Kernels "Session 10").
_MAX_BLOCK_V = 32768
# Below this many tokens a chunk turns the matmuls into slow GEMVs that re-read all of W; the extra
# logits memory of such a floor is small (128 x 256K bf16 = 64 MB). Tests lower it.
_MIN_CHUNK = 128
_REDUCTIONS = ("mean", "sum", "none")


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised buffer for outputs the kernels fully overwrite (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ---------------------------------------------------------------- Triton kernel
@triton.jit
def _ce_chunk_kernel(
    logits_ptr,  # (rows, V) chunk logits, row stride `stride`; overwritten by the gradient
    stride,
    labels_ptr,  # (rows,) int
    loss_ptr,  # (rows,) fp32 out (only with COMPUTE_LSE)
    lse_ptr,  # (rows,) fp32: written with COMPUTE_LSE, read otherwise
    scale_ptr,  # gradient scale: scalar (scale_stride 0) or per row (scale_stride 1), fp32
    scale_stride,
    V: tl.constexpr,  # constexpr: one compile per vocab size, and the interpreter (numpy >= 2.4)
    ignore_index,  # cannot loop to a runtime bound (triton-lang/triton#9171)
    softcap,
    inv_temp,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_LSE: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # grid: (rows,), one program per token row sweeping the vocabulary in BLOCK_V columns.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride  # int64 offsets: rows * V passes 2^31 at 256K vocab
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    cols = tl.arange(0, BLOCK_V)
    if COMPUTE_LSE:
        m = float("-inf")  # running max of z
        d = 0.0  # running sum of exp(z - m)
        z_y = 0.0  # the label's z, picked up in passing (no extra scattered load)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                # c * tanh(x / c), tanh(u) = 1 - 2 / (exp(2u) + 1): saturates without NaN
                x = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))
            z = tl.where(mask, x * inv_temp, float("-inf"))
            z_y += tl.sum(tl.where(offs == label, z, 0.0), axis=0)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(d)
        tl.store(loss_ptr + row, tl.where(valid, lse - z_y, 0.0))
        tl.store(lse_ptr + row, lse)
    else:
        lse = tl.load(lse_ptr + row)
    if COMPUTE_GRAD:
        scale = tl.where(valid, tl.load(scale_ptr + row * scale_stride).to(tl.float32), 0.0)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dz_dx = inv_temp
            if HAS_SOFTCAP:
                t = 1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0)
                x = softcap * t
                dz_dx = (1.0 - t * t) * inv_temp
            p = tl.exp(x * inv_temp - lse)
            g = (p - tl.where(offs == label, 1.0, 0.0)) * dz_dx * scale
            tl.store(row_ptr + offs, g.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # grid: (programs,), each scaling ITERS consecutive blocks; all exit at once when scale == 1.
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        first = tl.program_id(0).to(tl.int64) * ITERS * BLOCK
        for i in range(ITERS):
            offs = first + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask)
            tl.store(x_ptr + offs, (x.to(tl.float32) * scale).to(x.dtype), mask=mask)


def _scale_(t: torch.Tensor, scale: torch.Tensor, triton_on: bool) -> None:
    """t *= scale in place (scale a 0-d tensor), skipping the pass when scale is 1 on the device."""
    if not (triton_on and t.is_contiguous()) or t.numel() == 0:
        t.mul_(scale)
        return
    block = 4096
    programs = min(cdiv(t.numel(), block), 8 * sm_count(t.device))
    iters = cdiv(t.numel(), block * programs)
    launch(_scale_kernel, (programs,), t, scale.to(torch.float32).contiguous(), t.numel(), block, iters,
           num_warps=8)


# ---------------------------------------------------------------- per-chunk op, both backends
def _ce_chunk_triton(logits, labels, loss, lse, scale, ignore_index, softcap, inv_temp,
                     compute_lse, compute_grad) -> None:
    rows, vocab = logits.shape
    if rows == 0:
        return
    block = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab))
    launch(
        _ce_chunk_kernel, (rows,), logits, logits.stride(0), labels, loss, lse, scale,
        0 if scale.dim() == 0 else 1, vocab, ignore_index, float(softcap or 1.0), float(inv_temp),
        softcap is not None, compute_lse, compute_grad, block, num_warps=max(4, min(32, block // 512)),
    )


def _ce_chunk_torch(logits, labels, loss, lse, scale, ignore_index, softcap, inv_temp,
                    compute_lse, compute_grad) -> None:
    """The same contract as the Triton kernel, in fp32 torch over one chunk."""
    x = logits.float()  # (rows, V)
    if softcap is not None:
        t = torch.tanh(x / softcap)
        z, dz_dx = softcap * inv_temp * t, (1.0 - t * t) * inv_temp
    else:
        z, dz_dx = x * inv_temp, None
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long().unsqueeze(1)  # (rows, 1)
    if compute_lse:
        lse.copy_(torch.logsumexp(z, dim=1))
        loss.copy_(torch.where(valid, lse - z.gather(1, safe).squeeze(1), 0.0))
    if compute_grad:
        g = torch.exp(z - lse.unsqueeze(1))  # softmax
        g.scatter_add_(1, safe, -valid.to(g.dtype).unsqueeze(1))  # - onehot on valid rows
        g = g * dz_dx if dz_dx is not None else g * inv_temp
        g *= (scale.float() * valid).unsqueeze(1)  # scalar or per-row scale; 0 on ignored rows
        logits.copy_(g)


def _chunk_size(n: int, h: int, v: int, frozen: bool = False) -> int:
    """Tokens per chunk so that chunk logits (c * V) cost about as much as hidden (N * H).

    frozen: no (V, H) weight gradient is formed (LoRA's frozen head, or no gradient at all).
    Then the floor is 4x higher (512 rows): at about 128 rows the logits products run far below
    the matmul rate (bench/RESULTS.md, QLoRA "Session 5"), and 512 x 128K bf16 logits are
    131 MB, small beside the 1 GB weight gradient that the lower floor makes room for."""
    floor = _MIN_CHUNK * (4 if frozen else 1)
    c = max(n * h // max(v, 1), min(floor, n), 1)
    if c >= 128:
        c -= c % 128  # tile-friendly matmul shapes
    return min(c, max(n, 1))


def _chunked_pass(h, w, labels, loss, lse, scale, gh, gw, opts: dict, compute_lse: bool) -> None:
    """Sweep the chunks: logits -> CE kernel (loss/lse and/or in-place grad) -> grad matmuls.

    h `(N, H)`, w `(V, H)`, labels `(N,)`; loss, lse `(N,)` fp32; scale scalar or `(N,)` fp32;
    gh `(N, H)` or None; gw `(V, H)` or None, overwritten (N > 0; the caller zeroes it for N = 0).
    """
    n, hdim = h.shape
    vocab = w.shape[0]
    chunk = _chunk_size(n, hdim, vocab, frozen=gw is None)
    compute_grad = gh is not None or gw is not None
    op = _ce_chunk_triton if opts["triton"] else _ce_chunk_torch
    buf = _alloc((min(chunk, n), vocab), w.dtype, w.device)  # reused by all chunks
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        hc = h[s:e].to(w.dtype)
        logits = buf[: e - s]
        torch.mm(hc, w.t(), out=logits)
        op(logits, labels[s:e], loss[s:e], lse[s:e], scale if scale.dim() == 0 else scale[s:e],
           opts["ignore_index"], opts["softcap"], opts["inv_temp"], compute_lse, compute_grad)
        if gh is not None:
            if gh.dtype == logits.dtype:
                torch.mm(logits, w, out=gh[s:e])
            else:
                gh[s:e] = logits @ w
        if gw is not None:
            if s == 0:
                torch.mm(logits.t(), hc, out=gw)
            else:
                gw.addmm_(logits.t(), hc)


def _weight_grad(w: torch.Tensor, n: int) -> torch.Tensor:
    """grad_W's buffer: written by the first chunk, so zero-filled only when there is none."""
    return _alloc(w.shape, w.dtype, w.device) if n > 0 else torch.zeros_like(w)


# ---------------------------------------------------------------- autograd Functions
class _FusedLinearCE(torch.autograd.Function):
    """Scalar loss ("mean"/"sum") whose gradients are computed during forward.

    Backward: the grads were computed for grad_out = 1, so the chain rule only scales them:
    d/dh = grad_out * grad_h, d/dW = grad_out * grad_W, in place (no second (V, H) buffer).
    """

    @staticmethod
    def forward(ctx, h, w, labels, opts: dict, reduction: str, need_gh: bool, need_gw: bool):
        n = h.shape[0]
        loss = _alloc((n,), torch.float32, h.device)
        lse = _alloc((n,), torch.float32, h.device)
        if reduction == "mean":
            num_valid = (labels != opts["ignore_index"]).sum().clamp_(min=1)  # device tensor
            scale = num_valid.float().reciprocal()
        else:
            scale = torch.ones((), dtype=torch.float32, device=h.device)
        gh = _alloc(h.shape, h.dtype, h.device) if need_gh else None
        gw = _weight_grad(w, n) if need_gw else None
        _chunked_pass(h, w, labels, loss, lse, scale, gh, gw, opts, compute_lse=True)
        ctx.grads = (gh, gw)
        ctx.triton = opts["triton"]
        return loss.sum() * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_cross_entropy: backward can run only once per forward")
        gh, gw = ctx.grads
        ctx.grads = None  # the grads are scaled in place below and handed over, not kept
        # grad_out is a 0-d device tensor: testing it on the host would sync, so `_scale_` tests
        # it on the device (on a CPU there is nothing to gain, and the interpreter's bf16 casts
        # truncate instead of rounding, so torch multiplies there).
        for g in (gh, gw):
            if g is not None:
                _scale_(g, grad_out, ctx.triton and g.is_cuda)
        return gh, gw, None, None, None, None, None


class _PerTokenCE(torch.autograd.Function):
    """Per-token loss `(N,)` fp32.

    Backward, with g_i = grad_out_i: dx[i, v] = g_i (softmax(z)[i, v] - [v == y_i]) dz/dx, then
    grad_h = dx @ W and grad_W = dx^T @ h chunk by chunk.
    - `unit_grads` (W frozen, h needs a gradient): grad_h[i] = g_i u_i with
      u_i = (softmax(z_i) - onehot(y_i)) dz/dx @ W, formed in forward in the same sweep as the
      loss and saved `(N, H)` in hidden's dtype; backward scales each row by g_i (in fp32,
      rounded once to hidden's dtype).
    - otherwise g weights each row before the sum over tokens in grad_W, so forward saves `lse`
      and backward recomputes the chunk logits from it.
    """

    @staticmethod
    def forward(ctx, h, w, labels, opts: dict, unit_grads: bool):
        loss = _alloc((h.shape[0],), torch.float32, h.device)
        lse = _alloc((h.shape[0],), torch.float32, h.device)
        ones = torch.ones((), dtype=torch.float32, device=h.device)
        units = _alloc(h.shape, h.dtype, h.device) if unit_grads else None
        _chunked_pass(h, w, labels, loss, lse, ones, units, None, opts, compute_lse=True)
        ctx.unit_grads, ctx.units = unit_grads, units
        if not unit_grads:
            ctx.save_for_backward(h, w, labels, lse)
        ctx.opts = opts
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.unit_grads:
            if ctx.units is None:
                raise RuntimeError("chunked_token_logprobs: backward can run only once per forward")
            units, ctx.units = ctx.units, None  # scaled in place and handed over, not kept
            # bf16 x fp32 in place: the product is formed in fp32 and rounded once
            return units.mul_(grad_out.float().unsqueeze(1)), None, None, None, None
        h, w, labels, lse = ctx.saved_tensors
        need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = _alloc(h.shape, h.dtype, h.device) if need_gh else None
        gw = _weight_grad(w, h.shape[0]) if need_gw else None
        if need_gh or need_gw:
            row_scale = grad_out.float().contiguous()
            # compute_lse=False: the kernel reads lse and writes no loss (lse fills that slot)
            _chunked_pass(h, w, labels, lse, lse, row_scale, gh, gw, ctx.opts, compute_lse=False)
        return gh, gw, None, None, None


# ---------------------------------------------------------------- public API
def _flatten(hidden: torch.Tensor, w: torch.Tensor, ids: torch.Tensor):
    if hidden.shape[:-1] != ids.shape:
        raise ValueError(f"labels shape {tuple(ids.shape)} != hidden's leading {tuple(hidden.shape[:-1])}")
    if hidden.shape[-1] != w.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != lm_head in_features {w.shape[1]}")
    return hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1).contiguous()


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of `softcap(hidden @ lm_head_weight^T)` against `labels`, chunked.

    hidden `(N, H)` or `(B, T, H)`; lm_head_weight `(V, H)`; labels `(N,)` / `(B, T)`, already
    shifted by the caller, values in `[0, V)` or `ignore_index`. Returns an fp32 scalar for
    "mean" (over non-ignored tokens; 0 with zero grads when all are ignored) and "sum", or the
    per-token losses with hidden's leading shape for "none" (ignored tokens give 0).
    Peak extra memory: one `(C, V)` chunk of logits (about hidden's size) plus the gradients.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    h, y = _flatten(hidden, lm_head_weight, labels)
    opts = {"ignore_index": int(ignore_index), "softcap": softcap, "inv_temp": 1.0,
            "triton": use_triton(hidden, lm_head_weight, labels)}
    grad_on = torch.is_grad_enabled()
    if reduction == "none":
        units = _unit_grads(hidden, lm_head_weight)
        return _PerTokenCE.apply(h, lm_head_weight, y, opts, units).reshape(hidden.shape[:-1])
    return _FusedLinearCE.apply(h, lm_head_weight, y, opts, reduction,
                                grad_on and hidden.requires_grad, grad_on and lm_head_weight.requires_grad)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """log p(token_ids[i] | hidden[i]) = log_softmax(softcap(hidden @ W^T) / temperature)[token].

    hidden `(N, H)` or `(B, T, H)`; lm_head_weight `(V, H)`; token_ids with hidden's leading
    shape, values in `[0, V)` (-100 marks padding and gives 0 with no gradient). Returns fp32
    log-probs with token_ids' shape. Differentiable w.r.t. hidden and (if it requires grad) the
    weight: d logp_i / dx[i, v] = ([v == t_i] - softmax(z)[i, v]) * cap'(x) / temperature, with
    the chunk logits recomputed in backward (never stored).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    h, t = _flatten(hidden, lm_head_weight, token_ids)
    opts = {"ignore_index": -100, "softcap": softcap, "inv_temp": 1.0 / float(temperature),
            "triton": use_triton(hidden, lm_head_weight, token_ids)}
    # log p = -(lse - z_t): the per-token cross-entropy, negated.
    units = _unit_grads(hidden, lm_head_weight)
    return -_PerTokenCE.apply(h, lm_head_weight, t, opts, units).reshape(hidden.shape[:-1])


def _unit_grads(hidden: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a per-token call forms its hidden gradient in forward (`_PerTokenCE`): hidden
    needs one and the head's weight does not."""
    return torch.is_grad_enabled() and hidden.requires_grad and not w.requires_grad


# ---------------------------------------------------------------- full-logits references
def _full_logits(hidden: torch.Tensor, w: torch.Tensor, softcap: float | None) -> torch.Tensor:
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, w.dtype), torch.float32)
    hidden = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
    logits = hidden @ w.to(dtype).t()  # (N, V) fp32 (fp64 if given fp64)
    return softcap * torch.tanh(logits / softcap) if softcap is not None else logits


def fused_linear_cross_entropy_reference(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Test reference: `F.cross_entropy` on the full fp32 `(N, V)` logits (all-ignored mean -> 0)."""
    logits = _full_logits(hidden, lm_head_weight, softcap)
    y = labels.reshape(-1)
    losses = F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="none")
    if reduction == "none":
        return losses.reshape(labels.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (y != ignore_index).sum().clamp(min=1)


def token_logprobs_reference(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Test reference: `log_softmax(full fp32 logits / T).gather(token_ids)`."""
    logp = torch.log_softmax(_full_logits(hidden, lm_head_weight, softcap) / temperature, dim=-1)
    return logp.gather(1, token_ids.reshape(-1, 1)).reshape(token_ids.shape)
