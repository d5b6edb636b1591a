"""Rollouts: the current policy (LoRA applied unmerged) samples `num_generations` completions per
prompt through the fast decode path (`kestrel.decode.Generator`), all rows in one batch.

    gen = Generator(model, tokenizer, max_seq_len=max_prompt_length + max_completion_length)
    out = rollout(gen, tokenizer, prompt_ids, num_generations=8, max_new_tokens=256,
                  temperature=1.0, top_p=1.0, seed=step_seed, adapter="default")

Rows come out grouped by prompt (rows [k*G, (k+1)*G) share prompt k), which is the layout
`loss.group_advantages` expects. Row i samples with seed `seed + i`, so a run is reproducible and
no two rows of a step share a random stream. The generator copies the adapter weights in at the
start of every request, so each step samples from the weights the previous step produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kestrel.decode.generate import Generator
from kestrel.decode.sampling import SamplingParams


@dataclass
class Rollouts:
    """S = prompts * num_generations rows, grouped by prompt."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # the stop token kept when one ended the row (it is trained)
    texts: list[str]  # completions decoded without special tokens, for the rewards
    stopped: list[bool]  # False: the row ran into max_new_tokens

    def __len__(self) -> int:
        return len(self.completion_ids)

    def extend(self, other: Rollouts) -> None:
        self.prompt_ids += other.prompt_ids
        self.completion_ids += other.completion_ids
        self.texts += other.texts
        self.stopped += other.stopped


def decode_completions(tokenizer: Any, completions: Sequence[Sequence[int]], stop_ids: Sequence[int]) -> list[str]:
    """Text of each completion without its final stop token and without special tokens."""
    stops = set(stop_ids)
    trimmed = [list(c[:-1]) if c and c[-1] in stops else list(c) for c in completions]
    return tokenizer.batch_decode(trimmed, skip_special_tokens=True)


def rollout(
    generator: Generator,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    adapter: str | None,
) -> Rollouts:
    """Sample `num_generations` completions for each prompt (token ids) in one decode batch."""
    rows = [list(p) for p in prompts for _ in range(num_generations)]  # (S,) grouped by prompt
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)  # row i: seed + i
    out = generator.generate(rows, max_new_tokens=max_new_tokens, sampling=params, adapter=adapter)
    texts = decode_completions(tokenizer, out.tokens, generator.stop_ids)
    return Rollouts(rows, [list(t) for t in out.tokens], texts, [r == "stop" for r in out.finish_reasons])


def release(generator: Generator) -> None:
    """Free the decode session (its KV cache and captured graphs) before the update runs, so the
    cache and the training activations never hold memory at the same time."""
    generator.release()
