"""Several models of one vocabulary decoded as one batch: row group g runs on model g.

A LoRA run and its base share their weights, so the studio's side-by-side view decodes both
answers on one model with a per-row adapter mask (see `adapters.py`). A full fine-tune has its
own weights everywhere (embeddings and norms included), so no mask over one set of weights gives
the base model back. `ModelRows` puts both models behind one `DecodeBackend`: the batch of
B = n * k rows is split into n contiguous groups of k rows, group g reads model g with its own KV
cache, and the logits are concatenated back to (B, V). The `Generator` then runs one decode loop
for both: one prefill call, one step (one CUDA graph replay) per token for both models, one
sampling op, one host read per chunk, instead of two loops one after the other. Each step still
reads both models' weights, which no batching can avoid for two different sets of weights.

    gen = Generator(ModelRows([base_gen.backend, tuned_gen.backend]), tokenizer)
    out = gen.generate([ids, ids])      # row 0 from the base model, row 1 from the fine-tune
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kestrel.decode.adapters import LoraCall


class ModelRows:
    """A `DecodeBackend` over `members` (backends of the same vocabulary, device and dtype)."""

    def __init__(self, members: Sequence[Any]) -> None:
        if len(members) < 2:
            raise ValueError("ModelRows needs at least two models")
        first = members[0]
        for m in members[1:]:
            if (m.vocab_size, m.device, m.dtype) != (first.vocab_size, first.device, first.dtype):
                raise ValueError("models decoded as one batch need the same vocabulary size, device and dtype; "
                                 f"got {(first.vocab_size, first.device, first.dtype)} and "
                                 f"{(m.vocab_size, m.device, m.dtype)}")
        self.members = list(members)
        self.vocab_size, self.device, self.dtype = first.vocab_size, first.device, first.dtype
        self.adapters: list[str] = []  # rows choose a model, not an adapter

    @property
    def quantized(self) -> bool:
        return any(m.quantized for m in self.members)

    @property
    def compilable(self) -> bool:
        return all(getattr(m, "compilable", not m.quantized) for m in self.members)

    def _groups(self, batch: int) -> list[slice]:
        n = len(self.members)
        if batch % n:
            raise ValueError(f"a batch of {batch} rows does not split over {n} models")
        k = batch // n
        return [slice(g * k, (g + 1) * k) for g in range(n)]

    def new_cache(self, batch: int, length: int) -> list[Any]:
        k = batch // len(self._groups(batch))
        return [m.new_cache(k, length) for m in self.members]

    def prefill(self, ids: torch.Tensor, pad: torch.Tensor, cache: list[Any], lora: LoraCall | None) -> torch.Tensor:
        """ids (B, T) left-padded, pad (B,) -> last-token logits (B, V): group g from model g."""
        parts = [m.prefill(ids[sl], pad[sl], c, None) for m, c, sl in zip(self.members, cache, self._groups(len(ids)))]
        return torch.cat(parts)

    def step(self, tok: torch.Tensor, col: torch.Tensor, pad: torch.Tensor, cache: list[Any],
             lora: LoraCall | None) -> torch.Tensor:
        """tok (B,) at cache column col -> logits (B, V); no host reads (graph-capturable)."""
        parts = [m.step(tok[sl], col, pad[sl], c, None) for m, c, sl in zip(self.members, cache, self._groups(len(tok)))]
        return torch.cat(parts)

    def sync_lora(self) -> None:
        """Nothing to sync: no row applies an adapter."""

    def refresh(self) -> bool:
        """Every member's `refresh` (re-fuse, re-bind replaced weights); True when any changed."""
        changed = [m.refresh() for m in self.members if hasattr(m, "refresh")]
        return any(changed)

    def unfuse(self) -> None:
        for m in self.members:
            if hasattr(m, "unfuse"):
                m.unfuse()
