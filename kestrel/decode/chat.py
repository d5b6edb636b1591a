"""Chat-template helpers for decoding: prompt ids from messages, and the ids that end a turn."""

from __future__ import annotations

from typing import Any, Sequence

# End-of-turn markers of the common chat templates (ChatML, Llama 3, Gemma, Phi); a marker counts
# only when the tokenizer's own template writes it and the vocabulary has it as one token.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
# gpt-oss's harmony closes every message, its reasoning included, with <|end|>: its reply ends at
# <|return|>, or at <|call|> for a tool call. A template writing <|channel|> is harmony.
HARMONY_END_OF_TURN = ("<|return|>", "<|call|>")


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """EOS ids (tokenizer and generation config) plus the template's end-of-turn token ids."""
    ids = _as_list(getattr(tokenizer, "eos_token_id", None))
    ids += _as_list(getattr(generation_config, "eos_token_id", None))
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else " ".join(str(t) for t in template.values())
    unk = getattr(tokenizer, "unk_token_id", None)
    harmony = "<|channel|>" in template
    for marker in HARMONY_END_OF_TURN if harmony else END_OF_TURN:
        if harmony or marker in template:
            tid = tokenizer.convert_tokens_to_ids(marker)
            if isinstance(tid, int) and tid != unk:
                ids.append(tid)
    return sorted(set(ids))


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of `messages` with the chat template applied and the assistant turn opened."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
