"""Token sampling on the device without a host synchronisation, inside the captured decode step.

Order and semantics follow Hugging Face `generate` (repetition penalty, then temperature,
top-k, top-p, min-p), so greedy decoding is token-identical and the filters keep the same sets.
Each row has its own parameters (device tensors loaded per request); which filters exist in the
compiled graph at all is the static `SamplingPlan`, so plain greedy decoding is one argmax.

Randomness: no `torch.Generator` state. A counter-based hash of (row seed, step, token id) gives
the uniform u of every (row, token) at every step, and the sample is
`argmax(probs / -log(u))` (exponential race, equivalent to drawing from `probs`; gpt-fast's
trick, with no sync and no multinomial). Why a hash and not a generator: it is pure tensor
arithmetic, so a captured CUDA graph replays it with new values each step; a row's samples
depend only on its seed, so a batch and one-at-a-time runs agree; CPU and GPU give the same u.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """How one row picks its tokens. The defaults are greedy decoding."""

    temperature: float = 0.0  # 0 = greedy (argmax); HF's `do_sample=False`
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1 = off
    min_p: float = 0.0  # drop tokens below min_p times the top token's probability; 0 = off
    repetition_penalty: float = 1.0  # HF/CTRL penalty on every token already seen; 1 = off
    seed: int | None = None  # None draws one from torch's default generator (on the host)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


GREEDY = SamplingParams()


@dataclass(frozen=True)
class SamplingPlan:
    """The static shape of the sampling code: which filters the compiled step contains."""

    sample: bool = False  # some row has temperature > 0
    top_k: int = 0  # the largest top_k among sampling rows (torch.topk needs a static k)
    top_p: bool = False
    min_p: bool = False
    penalty: bool = False

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab_size: int) -> SamplingPlan:
        sampling = [p for p in params if p.temperature > 0]
        return cls(
            sample=bool(sampling),
            top_k=min(vocab_size, max((p.top_k for p in sampling), default=0)),
            top_p=any(p.top_p < 1.0 for p in sampling),
            min_p=any(p.min_p > 0.0 for p in sampling),
            penalty=any(p.repetition_penalty != 1.0 for p in params),
        )


class SamplingState:
    """Per-row sampling parameters as device tensors with fixed addresses, (B,) each."""

    def __init__(self, batch: int, vocab_size: int, device: torch.device) -> None:
        self.temperature = torch.zeros(batch, device=device)
        self.top_k = torch.zeros(batch, dtype=torch.long, device=device)
        self.top_p = torch.ones(batch, device=device)
        self.min_p = torch.zeros(batch, device=device)
        self.penalty = torch.ones(batch, device=device)
        self.seed = torch.zeros(batch, dtype=torch.long, device=device)
        self.seen = torch.zeros((batch, vocab_size), dtype=torch.bool, device=device)  # tokens so far

    def load(self, params: Sequence[SamplingParams]) -> None:
        """Copy one request's parameters in (small host-to-device copies, no sync)."""
        seeds = [p.seed if p.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()) for p in params]
        host = {
            "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32),
            "top_k": torch.tensor([p.top_k for p in params], dtype=torch.long),
            "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
            "min_p": torch.tensor([p.min_p for p in params], dtype=torch.float32),
            "penalty": torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
            "seed": torch.tensor([s & _M32 for s in seeds], dtype=torch.long),
        }
        for name, value in host.items():
            getattr(self, name).copy_(value, non_blocking=True)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), c < 2^32, with no int64 overflow: split x in halves."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding values < 2^32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seed (B,) long, step (1,) long -> u (B, V) float32 in (0, 1), a pure function of its inputs."""
    row = _mix32(seed ^ _mix32(step & _M32))[:, None]  # (B, 1)
    idx = torch.arange(vocab_size, device=seed.device)[None]  # (1, V)
    h = _mix32((_mix32(idx ^ row) + row) & _M32)  # (B, V)
    return ((h >> 8).float() + 0.5) * (1.0 / 16777216.0)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF's rule on every seen token: positive logits divided by the penalty, negative multiplied."""
    p = penalty[:, None]
    penalised = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalised, logits)


def filter_logits(scaled: torch.Tensor, plan: SamplingPlan, st: SamplingState) -> torch.Tensor:
    """Top-k, top-p and min-p on temperature-scaled logits (B, V): removed tokens become -inf.

    Each filter is a per-row threshold on the logit value, so no scatter is needed:
    top-k keeps logits >= the k-th largest; top-p keeps the sorted prefix whose preceding mass
    is < p (HF: ascending cumulative mass <= 1 - p is removed); min-p keeps p >= min_p * p_max.
    """
    inf = float("-inf")
    cutoff = torch.full_like(scaled[:, :1], inf)  # (B, 1): logits below it are removed
    on_k = st.top_k[:, None] > 0
    if plan.top_p:
        ordered = torch.sort(scaled, dim=-1, descending=True).values  # (B, V)
        if plan.top_k:
            kth = ordered.gather(-1, (st.top_k[:, None] - 1).clamp(0, scaled.shape[-1] - 1))
            cutoff = torch.where(on_k, kth, cutoff)
            ordered = torch.where(ordered < cutoff, inf, ordered)
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each sorted token
        keep = (before < st.top_p[:, None]) | (st.top_p[:, None] >= 1.0)
        last = keep.sum(-1, keepdim=True).clamp_min(1) - 1
        cutoff = torch.maximum(cutoff, ordered.gather(-1, last))
    elif plan.top_k:
        top = torch.topk(scaled, plan.top_k, dim=-1).values  # (B, k_max), descending
        kth = top.gather(-1, (st.top_k[:, None] - 1).clamp(0, plan.top_k - 1))
        cutoff = torch.where(on_k, kth, cutoff)
    out = torch.where(scaled < cutoff, inf, scaled)
    if plan.min_p:
        probs = out.softmax(-1)
        floor = st.min_p[:, None] * probs.amax(-1, keepdim=True)
        out = torch.where(probs < floor, inf, out)
    return out


def argmax_last(x: torch.Tensor, chunks: int = 64) -> torch.Tensor:
    """x (B, V) -> (B,) long: the first index of each row's maximum, as `argmax(-1)`.

    In two stages for a large V: compiled, a one-row argmax over 128K logits is one program on
    one SM, slow at every token (bench/RESULTS.md, Decode "Session 3"); as `chunks` per-chunk
    maxima, then the first chunk holding the overall maximum, it spreads over `chunks` programs.
    """
    b, v = x.shape
    if v < 16 * chunks * 8:
        return x.argmax(-1)
    width = -(-v // chunks)
    padded = F.pad(x, (0, width * chunks - v), value=float("-inf")).view(b, chunks, width)
    best, where = padded.max(-1)  # (B, chunks): first maximum inside each chunk
    chunk = best.argmax(-1)  # (B,): the first chunk holding the row's maximum
    return chunk * width + where.gather(-1, chunk[:, None])[:, 0]


def sample(logits: torch.Tensor, plan: SamplingPlan, st: SamplingState, step: torch.Tensor) -> torch.Tensor:
    """logits (B, V) float32 -> next tokens (B,) long. Rows with temperature 0 take the argmax."""
    if plan.penalty:
        logits = apply_repetition_penalty(logits, st.seen, st.penalty)
    greedy = argmax_last(logits)
    if not plan.sample:
        return greedy
    temperature = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    probs = filter_logits(logits / temperature[:, None], plan, st).softmax(-1)
    race = -torch.log(uniform_noise(st.seed, step, logits.shape[-1]))  # Exp(1) per token
    drawn = argmax_last(probs / race)
    return torch.where(st.temperature > 0, drawn, greedy)
