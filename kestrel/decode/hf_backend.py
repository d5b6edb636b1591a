"""The decode loop's backend for families that Kestrel's decode forward does not cover.

Qwen3.5 and Qwen3.5-MoE (linear-attention layers with a recurrent state), Gemma 4 (per-layer
inputs, shared K/V) and any family a later transformers adds decode through the model's own
forward with Hugging Face's cache: slower (no graph capture, no compile, one host read of the cache column a
step) but exact, so chat, the studio and GRPO rollouts work on every model that loads.

It speaks the `DecodeBackend` protocol of `generate.py`: rows are left-padded, a row's token at
cache column c has position c - pad[row], and pad columns are masked out (for linear attention
HF zeroes padded inputs, so a row's state starts at its first real token).

Adapters: `lora=None` runs the base model (PEFT's adapters disabled); a uniform `LoraCall(i)`
runs adapter i. Several adapters in one batch need the LoRA bank of Kestrel's decode forward.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from kestrel.decode.adapters import AdapterError, LoraCall

log = logging.getLogger("kestrel")


@dataclass
class HFCache:
    """One session's HF cache and its (B, S) attention mask over cache columns."""

    mask: torch.Tensor
    past: Any = field(default=None)


def decode_backend(model: nn.Module, max_seq_len: int, fuse: bool | None) -> Any:
    """Kestrel's decode forward (`DecodeModel`), or this backend for a family it does not cover."""
    from kestrel.decode.model import DecodeModel, UnsupportedModelError

    try:
        return DecodeModel(model, max_seq_len, fuse)
    except UnsupportedModelError as exc:
        log.warning("Kestrel's fast decode path does not cover this model (%s); generating through "
                    "Hugging Face's forward and cache (slower, same tokens).", exc)
        return HFDecodeBackend(model)


class HFDecodeBackend:
    """`DecodeBackend` over a Hugging Face causal LM (or image-text model, or its PEFT wrapper)."""

    compilable = False  # HF's dynamic cache changes shape every step
    graphable = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        embeddings = model.get_input_embeddings().weight
        self.device, self.dtype = embeddings.device, embeddings.dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.quantized = any(type(p).__name__ == "Params4bit" for p in model.parameters())
        peft_config = getattr(model, "peft_config", None)
        self.adapters: list[str] = list(peft_config) if peft_config else []

    def new_cache(self, batch: int, length: int) -> HFCache:
        return HFCache(torch.zeros((batch, length), dtype=torch.long, device=self.device))

    def sync_lora(self) -> None:  # PEFT's own layers run: nothing is copied
        return None

    @contextlib.contextmanager
    def _adapter(self, lora: LoraCall | None) -> Iterator[None]:
        if lora is not None and lora.index is None:
            raise AdapterError("different adapters for the rows of one batch need Kestrel's decode path, "
                               "which this model's family lacks; ask for one adapter per request")
        if not self.adapters:
            yield
        elif lora is None:
            with self.model.disable_adapter():
                yield
        else:
            self.model.set_adapter(self.adapters[lora.index])
            yield

    def _last_logits(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: HFCache,
                     lora: LoraCall | None) -> torch.Tensor:
        training = self.model.training
        self.model.eval()  # in training mode under gradient checkpointing HF turns the cache off (GRPO rollouts)
        try:
            with torch.no_grad(), self._adapter(lora):
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                 past_key_values=cache.past, use_cache=True, logits_to_keep=1)
        finally:
            self.model.train(training)
        cache.past = out.past_key_values
        return out.logits[:, -1].float()  # (B, V)

    def prefill(self, ids: torch.Tensor, pad: torch.Tensor, cache: HFCache, lora: LoraCall | None) -> torch.Tensor:
        """ids (B, T) left-padded, pad (B,) -> the last token's logits (B, V), cache filled."""
        t = ids.shape[1]
        cols = torch.arange(t, device=ids.device)
        cache.mask.zero_()
        cache.mask[:, :t] = (cols[None, :] >= pad[:, None]).long()
        cache.past = None
        positions = (cols[None, :] - pad[:, None]).clamp(min=0)  # (B, T)
        return self._last_logits(ids, cache.mask[:, :t], positions, cache, lora)

    def step(self, tok: torch.Tensor, col: torch.Tensor, pad: torch.Tensor, cache: HFCache,
             lora: LoraCall | None) -> torch.Tensor:
        """tok (B,) at cache column `col` (a (1,) tensor) -> next logits (B, V)."""
        c = int(col.item())  # the one host read a step: HF's cache grows by one column
        cache.mask[:, c] = 1
        positions = (col - pad)[:, None]  # (B, 1)
        return self._last_logits(tok[:, None], cache.mask[:, : c + 1], positions, cache, lora)
