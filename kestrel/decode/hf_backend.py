"""The decode loop's fallback backend: the Hugging Face model's own forward with its own cache.

For families `DecodeModel` has no forward for (mixture-of-experts blocks, gpt-oss's attention
sinks): chat and GRPO rollouts go through the same `Generator` (sampling, stop tokens, adapters
by name), one HF forward per token. Correct, not fast: no compiled step, no CUDA graph (the cache
grows, and a step reads its column on the host), and a batch runs one adapter at a time.

Layout as `DecodeModel`'s: prompts left-padded, `pad[b]` padding columns before row b's tokens,
a token at column c has position c - pad[b].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kestrel.decode.adapters import LoraCall
from kestrel.errors import KestrelError


@dataclass
class HFCache:
    """One session's Hugging Face cache and the columns that are padding."""

    batch: int
    length: int
    past: Any = None
    mask: torch.Tensor | None = field(default=None, repr=False)  # (B, columns so far) 1 = real token


class HFDecodeBackend:
    """`DecodeBackend` over a (possibly PEFT-wrapped) Hugging Face causal LM."""

    compilable = False
    graphable = False
    quantized = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        embed = lm.get_input_embeddings().weight
        self.device, self.dtype = embed.device, embed.dtype
        self.vocab_size = int(lm.get_output_embeddings().weight.shape[0])
        self.adapters: list[str] = list(getattr(model, "peft_config", {}) or {})

    def new_cache(self, batch: int, length: int) -> HFCache:
        return HFCache(batch, length)

    def sync_lora(self) -> None:
        """Adapters are read by the model's own forward at every call: nothing to copy."""

    @torch.no_grad()
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: HFCache, lora: LoraCall | None) -> torch.Tensor:
        if lora is not None and lora.index is None:
            raise KestrelError("this model decodes through Hugging Face's forward, which runs one adapter per "
                               "batch: give every prompt of a request the same adapter")
        kwargs = dict(input_ids=ids, attention_mask=cache.mask, position_ids=positions,
                      past_key_values=cache.past, use_cache=True)
        training = self.model.training
        self.model.eval()  # HF turns the cache off in training mode under gradient checkpointing
        try:
            if not self.adapters:
                out = self.model(**kwargs)
            elif lora is None:
                with self.model.disable_adapter():
                    out = self.model(**kwargs)
            else:
                self.model.set_adapter(self.adapters[lora.index])
                out = self.model(**kwargs)
        finally:
            self.model.train(training)
        cache.past = out.past_key_values
        return out.logits[:, -1].float()  # (B, V)

    def prefill(self, ids: torch.Tensor, pad: torch.Tensor, cache: HFCache, lora: LoraCall | None) -> torch.Tensor:
        """ids (B, T) left-padded, pad (B,) -> the last column's logits (B, V) fp32."""
        from transformers import DynamicCache

        lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        cols = torch.arange(ids.shape[1], device=ids.device)
        cache.mask = (cols[None, :] >= pad[:, None]).long()  # (B, T)
        cache.past = DynamicCache(config=lm.config)
        positions = (cols[None, :] - pad[:, None]).clamp(min=0)  # (B, T)
        return self._forward(ids, positions, cache, lora)

    def step(self, tok: torch.Tensor, col: torch.Tensor, pad: torch.Tensor, cache: HFCache,
             lora: LoraCall | None) -> torch.Tensor:
        """tok (B,) at column `col` (a (1,) tensor) -> logits (B, V) fp32."""
        assert cache.mask is not None, "step before prefill"
        c = int(col.reshape(-1)[0])  # the cache grows column by column: its length is read on the host
        if cache.mask.shape[1] != c:
            raise KestrelError(f"decode step at column {c}, but the cache holds {cache.mask.shape[1]} columns")
        cache.mask = torch.cat([cache.mask, cache.mask.new_ones(cache.batch, 1)], dim=1)
        positions = (c - pad).reshape(-1, 1).clamp(min=0)  # (B, 1)
        return self._forward(tok.reshape(-1, 1), positions, cache, lora)
