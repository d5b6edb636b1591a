"""Attention layouts for the training path, chosen once per forward by `kestrel.model.decoder_stack`.

Three layouts, as in Unsloth's model-level patch:

- plain causal (no padding, no packing): no mask at all, SDPA runs with `is_causal`;
- everything the varlen path cannot run (CPU, fp32, a mask with holes): the mask Hugging Face itself builds
  (its own `create_causal_mask` / `create_sliding_window_causal_mask`, so the math is HF's);
- packed rows (several samples in a row, `position_ids` restarting) and padded rows on CUDA in
  fp16/bf16: variable-length attention (`torch.nn.attention.varlen.varlen_attn`) over the samples
  (and runs of padding) laid end to end, so no (B, 1, T, T) mask is ever built. Sliding-window
  layers on rows longer than the window use the same kernel with one "sample" per row and a window.

Samples that share a prefix (a preference pair's prompt, then its chosen and its rejected answer)
run as one query sample per branch with keys of their own (`ForkedSamples`): queries [P B1 B2],
keys gathered as [P B1 | P B2], so the prefix is computed once and B2 never sees B1.

The varlen function is a parameter (`VarlenFn`), never a global: `reference_varlen_attn` computes
the same thing with a loop of SDPA calls and runs on a CPU, so tests check the whole varlen path
against the unpatched model there.

Attention sinks (gpt-oss) run the same layouts through `kestrel.model.sink_attention` on CUDA
(flash's forward and backward around the sink's softmax share) and through the reference's
explicit sink softmax elsewhere. HF itself runs sinks only in eager attention (no SDPA), so sink
families take the varlen kernel on unpacked rows too, wherever it can run.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F

from kestrel.model.registry import FamilySpec
from kestrel.model.sink_attention import flash_sink_varlen_attn

HALF = (torch.float16, torch.bfloat16)
# varlen_attn's signature: (q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size[, enable_gqa][, sinks])
VarlenFn = Callable[..., torch.Tensor]
VarlenMode = Literal["auto", "off", "reference"]
VARLEN_KWARG = "kestrel_varlen"  # the keyword the model forward hands each patched attention layer
FORK_KWARG = "kestrel_forked_samples"  # the keyword a caller hands the model forward (`ForkedSamples`)
STARTS_KWARG = "kestrel_host_starts"  # the keyword a caller hands the model forward (`HostStarts`)
Plan = Literal["varlen_samples", "varlen_rows", "hf_mask"]


# --- Which layers slide, and by how much ----------------------------------------------------


def layer_window(spec: FamilySpec, config: Any, layer_idx: int) -> int | None:
    """The sliding window W of layer `layer_idx` (None for full attention).

    HF's window W lets query i see keys j with i - W < j <= i (masking_utils.sliding_window_overlay).
    """
    window = getattr(config, "sliding_window", None)
    if spec.sliding_layers == "all":  # Mistral: config.sliding_window, when set, applies to every layer
        return window
    if spec.sliding_layers == "by_layer_type":  # Qwen2/3, Gemma 3: config.layer_types says which
        return window if config.layer_types[layer_idx] == "sliding_attention" else None
    return None


def flash_window(window: int | None) -> tuple[int, int]:
    """HF's window W as flash's (left, right): W - 1 keys back, none ahead; (-1, 0) is causal."""
    return (-1, 0) if window is None else (window - 1, 0)


# --- Samples inside the flattened batch -----------------------------------------------------


@dataclass(frozen=True)
class Samples:
    """Where each sample lies once the (B, T) batch is flattened to B*T tokens."""

    cu_seqlens: torch.Tensor  # (S+1,) int32 on the batch's device: start offsets, then B*T
    max_len: int  # the longest sample, in tokens


@dataclass(frozen=True)
class KeyLayout:
    """Keys laid out apart from the queries: key row i is the flattened (B*T) k/v row `index[i]`,
    and key sample s (`samples`) is what query sample s attends to, its end aligned with the
    query sample's end (flash's bottom-right causal alignment)."""

    index: torch.Tensor  # (Tk,) int64 on the batch's device
    samples: Samples  # the keys' cu_seqlens (as many entries as the queries'), Tk as the longest


@dataclass(frozen=True)
class ForkedSamples:
    """A flattened batch of groups [prefix, branch 1, ..., branch k] (one row, B = 1), each branch
    a continuation of the prefix alone: query samples [prefix + branch 1], [branch 2], ...,
    [branch k]; key samples [prefix + branch 1], [prefix + branch 2], ... (`fork_layout`).
    Positions of branch i restart where the prefix ends (the caller's position_ids)."""

    queries: Samples
    keys: KeyLayout


@dataclass(frozen=True)
class VarlenCall:
    """What one attention layer needs to run variable-length attention."""

    samples: Samples
    window: tuple[int, int]  # flash-style (left, right), see `flash_window`
    fn: VarlenFn
    keys: KeyLayout | None = None  # None: each query sample attends to itself


def sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids -> (B, T) bool, True where a sample begins.

    HF's rule (masking_utils.find_packed_sequence_indices): a new sample starts wherever the
    position does not step by exactly 1. Column 0 always starts one: a sample never spans rows.
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return starts


def segment_starts(
    attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, batch: int
) -> torch.Tensor | None:
    """(B, T) bool on the host: where a sample, or the run of right padding, begins. None unless
    every row is real tokens then padding (as `kestrel.data.collate` pads): with a hole HF lets
    tokens see across it, and with left padding the last pad position's output predicts the
    first real token in the loss, so only HF's own mask reproduces HF there.

    Right padding as its own segment is exact: the real tokens attend causally among themselves,
    as HF's mask allows, and the pad positions' outputs (which differ from HF's) only predict
    ignored labels. One host copy: the starts and the check travel together.
    """
    starts = sample_starts(position_ids.expand(batch, -1)) if position_ids is not None else None
    if attention_mask is None:
        return None if starts is None else starts.cpu()
    mask = attention_mask.bool()
    edges = torch.ones_like(mask)
    edges[:, 1:] = mask[:, 1:] != mask[:, :-1]
    starts = edges if starts is None else starts | edges
    rises = torch.zeros_like(mask)
    rises[:, 1:] = mask[:, 1:] & ~mask[:, :-1]  # a real token after a pad: a hole or left padding
    starts, rises = torch.stack([starts, rises]).cpu()
    return None if bool(rises.any()) else starts


@dataclass(frozen=True)
class HostStarts:
    """`segment_starts` of a batch, computed by the caller from its host copy before the batch went to
    the device, and handed to the model forward (keyword `STARTS_KWARG`) so that the forward need not
    read the device copy back. That read is a host sync: it waits for the GPU to finish everything
    queued before it (the previous step's backward and optimizer), and the GPU then idles while the
    host launches the new step's first work. starts: (B, T) bool on the host, or None (HF's mask)."""

    starts: torch.Tensor | None


def host_starts(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, batch: int) -> HostStarts:
    """`HostStarts` of a batch from its host tensors: what `segment_starts` would read from their device
    copies (the same function, so the two cannot disagree), with no sync."""
    for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"host_starts needs the batch's host {name} (got one on {t.device}): compute it "
                             "before moving the batch to the device")
    return HostStarts(segment_starts(attention_mask, position_ids, batch))


def segment_capacity(count: int) -> int:
    """Room for `count` cu_seqlens entries: the next power of four (at least 16), so batches
    whose number of samples varies share a few shapes (a CUDA graph replays one shape); the
    empty samples that fill it cost the kernels one early exit each."""
    room = 16
    while room < count:
        room *= 4
    return room


def samples_from_starts(starts: torch.Tensor, device: torch.device) -> Samples:
    """`sample_starts` (on the host) -> cu_seqlens on `device` and the longest sample.

    cu_seqlens is padded to `segment_capacity` with empty samples at the end, and the longest
    sample is taken as the row width: both then depend only on the batch's shape and the power
    of four above its number of samples, not on where the samples fall (a graph replays any layout of them;
    the kernels skip the empty samples' and short samples' blocks).

    The host copy of `starts` is the one sync of the forward; the copy of cu_seqlens back goes
    through pinned memory so it does not wait for the GPU.
    """
    flat = starts.reshape(-1)
    begin = flat.nonzero().reshape(-1)  # (S,) start offsets in B*T
    room = segment_capacity(begin.numel() + 1)
    cu = torch.full((room,), flat.numel(), dtype=torch.int32)  # (room,): the S+1 bounds, then empty samples
    cu[: begin.numel()] = begin
    return Samples(to_device_async(cu, device), starts.shape[-1])


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; through pinned memory on CUDA, so the copy does not wait for the GPU (a plain
    `torch.tensor(..., device=...)` or `.to(device)` from the host waits for the stream's queued work)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def fork_layout(
    groups: list[tuple[int, list[int]]], width: int, key_width: int, device: torch.device
) -> ForkedSamples:
    """`ForkedSamples` of groups (prefix length P, branch lengths [B1, ..., Bk]) laid end to end
    in a row of `width` tokens, whose keys take `key_width` rows.

    Group g at offset a: query samples [a, a+P+B1), then each later branch alone; key samples
    rows a..a+P+B1, then for branch i rows a..a+P and its own rows. The row's tail (padding,
    width - sum(P + sum B) tokens) is one more query sample whose key sample is the tail itself
    after (key_width - keys so far - tail) copies of the tail's first row, so the key side has
    the fixed width a CUDA graph replays; those pad queries' outputs feed nothing, so the copies
    get a zero gradient. A tail is needed whenever key rows are left over. cu_seqlens of both
    sides are padded to `segment_capacity` with empty samples, as `samples_from_starts` pads.
    Built on the host once per forward: no device sync, none per layer.
    """
    q_bounds, k_bounds, index = [0], [0], []
    at = 0
    for prefix, branches in groups:
        if prefix < 1 or not branches or min(branches) < 1:
            raise ValueError(f"a forked group needs a prefix and non-empty branches, got {prefix} and {branches}")
        first = at + prefix + branches[0]
        index.extend(range(at, first))
        q_bounds.append(first)
        k_bounds.append(len(index))
        start = first
        for length in branches[1:]:
            index.extend(range(at, at + prefix))
            index.extend(range(start, start + length))
            start += length
            q_bounds.append(start)
            k_bounds.append(len(index))
        at = start
    spare = key_width - len(index) - (width - at)
    if at > width or spare < 0 or (spare > 0 and width == at):
        raise ValueError(f"{at} query and {len(index)} key tokens do not fit widths {width} and {key_width} "
                         "(left-over key rows need a padding tail to sit in)")
    if width > at:
        index.extend([at] * spare + list(range(at, width)))
        q_bounds.append(width)
        k_bounds.append(key_width)
    room = segment_capacity(len(q_bounds))
    cu_q, cu_k = torch.full((room,), width, dtype=torch.int32), torch.full((room,), key_width, dtype=torch.int32)
    cu_q[: len(q_bounds)], cu_k[: len(k_bounds)] = torch.tensor(q_bounds), torch.tensor(k_bounds)
    keys = KeyLayout(to_device_async(torch.tensor(index, dtype=torch.long), device),
                     Samples(to_device_async(cu_k, device), key_width))
    return ForkedSamples(Samples(to_device_async(cu_q, device), width), keys)


def row_samples(batch: int, seq_len: int, device: torch.device) -> Samples:
    """One sample per row (unpacked rows): cu_seqlens = 0, T, 2T, ..., B*T. No host sync."""
    cu = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
    return Samples(cu, seq_len)


# --- The dispatch decision ------------------------------------------------------------------


def varlen_backend(
    mode: VarlenMode, device: torch.device, dtype: torch.dtype, dropout: bool, sinks: bool = False
) -> VarlenFn | None:
    """The varlen function for this forward, or None when the mask path must run.

    `auto`: torch's `varlen_attn` (flash) on CUDA in fp16/bf16, `flash_sink_varlen_attn` for a
    family with attention `sinks`; `reference`: the SDPA loop on any device (tests, debugging);
    `off`: never. The kernel has no dropout, so dropout means None.
    """
    if mode == "off" or dropout:
        return None
    if mode == "reference":
        return reference_varlen_attn
    if device.type != "cuda" or dtype not in HALF:
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch older than 2.10
        return None
    return flash_sink_varlen_attn if sinks else varlen_attn


def plan_layer(
    *, padded: bool, packed: bool, window: int | None, seq_len: int, varlen: bool, sinks: bool = False
) -> Plan:
    """How the layers of one window size attend in this forward.

    `varlen_samples`: packed rows through the varlen kernel; `varlen_rows`: a sliding layer over
    rows longer than its window (one sample per row), which spares the dense windowed mask, and
    every layer of a family with attention `sinks` (HF's path for those is eager attention);
    `hf_mask`: HF's own mask (None for plain causal under SDPA, so SDPA runs `is_causal`).
    """
    if padded or not varlen:
        return "hf_mask"
    if packed:
        return "varlen_samples"
    if sinks or (window is not None and seq_len > window):
        return "varlen_rows"
    return "hf_mask"


# --- Running it -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _takes_enable_gqa(fn: VarlenFn) -> bool:
    # torch 2.11's varlen_attn has no enable_gqa; 2.13's has.
    return "enable_gqa" in inspect.signature(fn).parameters


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: VarlenCall, scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Variable-length attention over the samples of a flattened batch.

    q (B, Hq, T, D), k and v (B, Hkv, T, D), as the attention forward holds them after RoPE
    (usually transposed views of (B, T, H, D) memory, so the reshapes below are free); sinks
    (Hq,) the attention sinks' logits, or None. Returns (B, T, Hq * D), ready for o_proj.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    q_, k_, v_ = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (q, k, v))  # (B*T, H, D)
    key_samples = call.samples
    if call.keys is not None:  # (Tk, Hkv, D); the backward adds each copy's gradient into its row (index_add)
        k_, v_ = k_.index_select(0, call.keys.index), v_.index_select(0, call.keys.index)
        key_samples = call.keys.samples
    extra: dict[str, Any] = {} if sinks is None else {"sinks": sinks}
    if hkv != hq:
        if _takes_enable_gqa(call.fn):
            extra["enable_gqa"] = True
        else:  # query head h reads KV head h // (Hq / Hkv), as HF's repeat_kv lays them out
            k_, v_ = (x.repeat_interleave(hq // hkv, dim=1) for x in (k_, v_))
    cu_q, n_q = call.samples.cu_seqlens, call.samples.max_len
    cu_k, n_k = key_samples.cu_seqlens, key_samples.max_len
    out = call.fn(q_, k_, v_, cu_q, cu_k, n_q, n_k, scale=scale, window_size=call.window, **extra)  # (B*T, Hq, D)
    return out.reshape(b, t, hq * d)


def window_mask(queries: int, keys: int, window: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(Lq, Lk) bool, True where query i may see key j under flash's (left, right) window,
    aligned bottom-right as flash aligns it: query i stands at key position i + Lk - Lq (the
    queries are the last Lq of the keys' positions)."""
    i = torch.arange(queries, device=device)[:, None] + (keys - queries)
    j = torch.arange(keys, device=device)[None, :]
    left, right = window
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= i - j <= left
    if right >= 0:
        allowed &= j - i <= right
    return allowed


def sink_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention whose softmax has one more key per head: logit sinks[h], value 0 (HF's eager gpt-oss).

    q (B, Hq, Lq, D), k and v (B, Hq, L, D) (KV heads already repeated), allowed (Lq, L) bool or
    any shape that broadcasts to (B, Hq, Lq, L), sinks (Hq,); returns (B, Hq, Lq, D). Explicit on
    purpose: autograd gives the exact gradients.
    """
    scores = (q @ k.transpose(-1, -2)) * scale  # (1, Hq, L, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (1, Hq, L, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # the sink's share dropped
    return probs.to(v.dtype) @ v


def reference_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`varlen_attn`'s math on any device: one SDPA call per sample with the window as a mask
    (`sink_softmax_attention` in its place when attention `sinks` (Hq,) are given).

    query (total_q, Hq, D), key/value (total_k, Hkv, D); returns (total_q, Hq, D). A query
    sample shorter than its key sample is aligned bottom-right (`window_mask`), as flash does.
    Slow (a host sync per sample); for tests and debugging.
    """
    pieces = []
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        if q1 - q0 > k1 - k0:
            raise ValueError(f"a query sample of {q1 - q0} tokens has only {k1 - k0} keys; bottom-right alignment "
                             "needs at least as many keys as queries")
        if q1 == q0:
            continue  # an empty sample (cu_seqlens padded to its capacity)
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query[q0:q1], key[k0:k1], value[k0:k1]))  # (1, H, L, D)
        mask = window_mask(q1 - q0, k1 - k0, tuple(window_size), query.device)  # (Lq, Lk)
        if sinks is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))  # as HF's repeat_kv
            o = sink_softmax_attention(q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale, sinks)
        pieces.append(o.squeeze(0).transpose(0, 1))  # (L, Hq, D)
    return torch.cat(pieces)
