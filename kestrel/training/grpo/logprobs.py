"""Per-token log-probs of completions, from hidden states in chunks: `(rows, length, vocab)`
logits never exist.

    lp = completion_logprobs(model, input_ids, starts, targets, temperature)   # (R, L) fp32

The decoder stack runs once over `prompt + completion` rows (right-padded, so plain causal
attention is exact for every real token and no mask is needed). The hidden state just before each
completion token is gathered, `(R, L, H)`, and `kestrel.kernels.chunked_token_logprobs` projects it through
the LM head a chunk of tokens at a time:

    logp[r, j] = log_softmax(cap(h[r, s_r - 1 + j] @ W^T) / T)[y[r, j]]

Backward recomputes each chunk's logits from the saved hidden states (see kestrel/kernels/cross_entropy.py),
so the memory of this step is that of the hidden states, about `H / V` of the logits'.
"""

from __future__ import annotations

import torch
from torch import nn

from kestrel import kernels
from kestrel.errors import ConfigError
from kestrel.model.multimodal import language_stack
from kestrel.model.registry import is_image_text, logit_softcap

PAD = -100  # a target that is not a completion token: log-prob 0, no gradient


def causal_lm(model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_lm_head(model: nn.Module, method: str = "GRPO") -> None:
    """The LM head must be a plain linear: an adapter on it would be skipped by the chunked path."""
    head = causal_lm(model).lm_head
    if hasattr(head, "lora_A"):
        raise ConfigError(f"{method} does not train a LoRA adapter on lm_head; remove lm_head from lora.targets")


def completion_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    starts: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log pi(completion token | everything before it), chunked over the vocabulary.

    input_ids (R, T): prompt then completion per row, right-padded; starts (R,) long: the column
    of each row's first completion token (its prompt length, >= 1); targets (R, L): completion
    tokens, PAD past each row's end. Returns (R, L) fp32, 0 at PAD. Differentiable w.r.t. the
    trainable weights when grad is enabled; the adapter state (enabled or disabled) is the caller's.
    """
    lm = causal_lm(model)
    image_text = is_image_text(lm.config)  # then its language model's stack and config
    stack = language_stack(lm)[1] if image_text else lm.model
    hidden = stack(input_ids=input_ids, use_cache=False).last_hidden_state  # (R, T, H)
    rows, length = targets.shape
    cols = starts[:, None] - 1 + torch.arange(length, device=starts.device)[None]  # (R, L)
    cols = cols.clamp(max=hidden.shape[1] - 1)  # past a row's end: any column, its target is PAD
    h = hidden.gather(1, cols[..., None].expand(rows, length, hidden.shape[-1]))  # (R, L, H)
    softcap = logit_softcap(lm.config)
    return kernels.chunked_token_logprobs(h, lm.lm_head.weight, targets, temperature=temperature, softcap=softcap)


def pack_rows(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of prompt + completion ids -> input_ids (R, T) right-padded with `pad_id`,
    starts (R,) (prompt lengths) and targets (R, L) (completions, PAD-filled), on `device`."""
    rows = len(prompts)
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    length = max(len(c) for c in completions)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    targets = torch.full((rows, length), PAD, dtype=torch.long)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        ids[r, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        targets[r, : len(c)] = torch.tensor(c, dtype=torch.long)
    starts = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return ids.to(device), starts.to(device), targets.to(device)
