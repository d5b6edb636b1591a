"""Adapter weights in the compute dtype, cast once per optimizer step instead of once per use.

PEFT keeps LoRA's A and B in fp32 (the optimizer's master copy) while the products run in bf16.
Casting at every use made a QLoRA step of the 8B shape launch about a thousand small copy kernels
(each projection's B in its forward, again in its backward, the stacked A's of Q/K/V and gate/up),
and on that step the host, not the GPU, was the limit (bench/RESULTS.md, QLoRA "Session 7").
`cast` and `stacked` keep the cast copy with the weight and reuse it until the weight may have changed. A copy is valid while
- no optimizer has stepped since it was made (a global step post-hook drops every copy: torch's
  fused AdamW updates parameters without bumping their version counters, and a copy that could
  never be used again would otherwise stay until its weight is cast anew, or for ever where a
  CUDA graph now does the casting),
- the weight's version counter is unchanged (in-place updates: `load_state_dict`, `copy_`),
- and so is its data pointer (a `.data` swap).
The cache is keyed weakly by the weight, so it goes with it; its cost is one 16-bit copy of the
adapter (about 85 MB for the 8B shape at r = 16), from a step's first use to the optimizer step,
so it stands at the step's memory peak. It pays only where the host sets a step's pace. A run
whose CUDA graphs are chosen by timing (`cuda_graphs: auto`) runs a layer eagerly only where
graphs, which take every cast off the host's path, did not win: there the GPU sets the pace and
hides the launches the cache would save. Such a run marks its adapters (`cast_fresh`,
`kestrel.recompute.checkpoint.set_gradient_checkpointing`), and their casts are made at each use
and never kept.
While a CUDA graph is captured (a replay runs no Python, so a kept copy would go stale in it, and a
copy made there would come from the graph's pool) every call casts afresh and nothing is kept. That
is asked of the calling thread's current stream, not of a flag set around the capture: a backward
run from a capture on the main thread (`torch.autograd.grad` in a layer's first pass,
`kestrel.recompute.layer_graphs`) runs the LoRA Functions' backward on autograd's device thread,
which does not see a context variable set on the main thread; its current stream is the capture
stream, as in the forward it records. (A context variable there baked an eager micro-batch's kept
copies into the backward graph, freed at the optimizer step: NaN gradients from the next step on.)

`mm_to` gives a product in another dtype: the fp32 adapter gradients are written by cuBLAS in
fp32 directly (`out_dtype`, CUDA) rather than rounded to bf16 and copied up.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

# Keyed by identity (a tensor's == is elementwise, so a plain WeakKeyDictionary cannot hold them).
_CASTS = WeakIdKeyDictionary()  # weight -> (stamp, copy)
_STACKS = WeakIdKeyDictionary()  # first weight -> (stamp, copy)


def _drop_all(*_: object) -> None:
    """After any optimizer's step: every kept copy may be stale."""
    _CASTS.clear()
    _STACKS.clear()


register_optimizer_step_post_hook(_drop_all)


_FRESH = "_kestrel_cast_fresh"  # the attribute `cast_fresh` sets on a weight


def cast_fresh(weights: Iterable[torch.Tensor], fresh: bool) -> None:
    """Mark `weights` (fresh: their casts are made at each use and never kept) or unmark them."""
    for w in weights:
        if fresh:
            setattr(w, _FRESH, True)
        elif _FRESH in w.__dict__:
            delattr(w, _FRESH)


def _capturing(t: torch.Tensor) -> bool:
    """Whether a cast of t now would be recorded into a CUDA graph being captured."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _keeps(t: torch.Tensor) -> bool:
    """Whether t's cast copy is kept: not for a weight marked fresh, nor inside a capture."""
    return not getattr(t, _FRESH, False) and not _capturing(t)


def _stamp(t: torch.Tensor) -> tuple[int, int, int]:
    """What changes when t's values may have, between optimizer steps: its identity, version and
    address."""
    return id(t), t._version, t.data_ptr()


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype` (t itself when it already is), the copy kept while t is unchanged. Not
    autograd-aware: for use inside the LoRA autograd Functions, which do their own backward."""
    if t.dtype == dtype:
        return t
    if not _keeps(t):
        return t.detach().to(dtype)
    stamp = (_stamp(t), dtype)
    hit = _CASTS.get(t)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    copy = t.detach().to(dtype)
    _CASTS[t] = (stamp, copy)
    return copy


def stacked(ts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[t_1; ...; t_n] (concatenated along dim 0) in `dtype`, kept while every t_k is unchanged."""
    if len(ts) == 1:
        return cast(ts[0], dtype)
    if not _keeps(ts[0]):
        return torch.cat([t.detach() for t in ts]).to(dtype)
    stamp = (tuple(_stamp(t) for t in ts), dtype)
    hit = _STACKS.get(ts[0])
    if hit is not None and hit[0] == stamp:
        return hit[1]
    copy = torch.cat([t.detach() for t in ts]).to(dtype)
    _STACKS[ts[0]] = (stamp, copy)
    return copy


def mm_to(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b (2-D) returned in `dtype`: for 16-bit a, b and an fp32 result on CUDA, cuBLAS writes
    fp32 from its fp32 accumulator (no bf16 rounding, no copy kernel); elsewhere a cast after."""
    if dtype == a.dtype:
        return torch.mm(a, b)
    if a.is_cuda and dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=dtype)
    return torch.mm(a, b).to(dtype)


def clear() -> None:
    """Forget every kept copy (tests)."""
    _CASTS.clear()
    _STACKS.clear()
