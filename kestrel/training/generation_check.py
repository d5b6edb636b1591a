"""The generation check: a few held-out prompts answered greedily through the fast decode path
at the end of a run, scored against their reference answers, stored with the run.

    check = GenerationCheck.from_conversations(eval_convs, tokenizer, max_prompt_tokens=1024)
    summary = check.run(model, tokenizer, output_dir, step)   # writes output_dir/generation_check.json
    summary = check.run(model, tokenizer, output_dir, step, seconds=2.5)   # stops decoding after 2.5 s

The file holds {"step", "exact_match", "rouge_l" (means over the prompts), "seconds" (the time
budget, null for none), "stopped_early" (answers cut by it), "rows": [{"line", "prompt",
"reference", "answer", "finished", "exact_match", "rouge_l"}]} (scores: `kestrel.training.scores`).
A row's "finished" says why its answer ended: "stop" (a stop token), "length" (the token limit) or
"time" (the time budget ran out first). Answers cut by time are scored as they are, against the
whole reference, so their scores read low: they say the budget ran out, not that the model erred.
Files written before the budget lack "seconds", "stopped_early" and "finished".

A prompt is a conversation without its last assistant turn, which is the reference; rows of
raw text (no turns) have no reference and are not used. The end-of-run check has a time budget
(`kestrel.training.eval_schedule.EvalSchedule.check_seconds`), so evaluation stays within its
share of a short run's time; the on-demand check (`kestrel.training.check_run`) has none.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kestrel.training.scores import exact_match, rouge_l

if TYPE_CHECKING:  # the studio reads GENERATION_FILE without importing torch
    from torch import nn

    from kestrel.data.formats import Conversation

GENERATION_PROMPTS = 8  # prompts of the check: enough to read, few enough to cost seconds
MAX_NEW_TOKENS = 256
GENERATION_FILE = "generation_check.json"


@dataclass
class GenerationCase:
    ids: list[int]  # the rendered prompt, assistant turn opened
    prompt: str  # the last user message, as shown
    reference: str
    line: int


class GenerationCheck:
    """Held-out prompts and their references; `run` answers and scores them."""

    def __init__(self, cases: list[GenerationCase], max_new_tokens: int, generator: Any = None) -> None:
        """`generator`: the run's own decode `Generator` when it has one (GRPO), else one is made."""
        self.cases, self.max_new_tokens, self.generator = cases, max_new_tokens, generator

    @classmethod
    def from_conversations(cls, convs: list[Conversation], tokenizer: Any, max_prompt_tokens: int,
                           limit: int = GENERATION_PROMPTS) -> "GenerationCheck":
        """The first `limit` conversations that end with an assistant turn and whose prompt fits
        `max_prompt_tokens`; answers may run to the longest reference plus a margin."""
        from kestrel.decode.chat import encode_chat

        cases: list[GenerationCase] = []
        for conv in convs:
            if len(cases) >= limit:
                break
            msgs = conv.messages
            if conv.text is not None or len(msgs) < 2 or msgs[-1]["role"] != "assistant":
                continue
            ids = encode_chat(tokenizer, msgs[:-1])
            if len(ids) > max_prompt_tokens:
                continue
            user = next((m["content"] for m in reversed(msgs[:-1]) if m["role"] == "user"), "")
            cases.append(GenerationCase(ids, user, msgs[-1]["content"], conv.line))
        return cls.sized(cases, tokenizer)

    @classmethod
    def sized(cls, cases: list[GenerationCase], tokenizer: Any) -> "GenerationCheck":
        """A check of `cases` whose answers may run to the longest reference plus a margin."""
        longest = max((len(tokenizer(c.reference, add_special_tokens=False)["input_ids"]) for c in cases), default=0)
        return cls(cases, min(MAX_NEW_TOKENS, longest + 16))

    def run(self, model: nn.Module, tokenizer: Any, output_dir: Path, step: int,
            seconds: float | None = None) -> dict[str, Any]:
        """Answer every prompt greedily in one decode batch, score, write GENERATION_FILE; returns
        what was written. With `seconds`, decoding stops before the chunk that would end more than
        that many seconds after this call began (the generator's making included; `answer`); every
        answer keeps at least the first token. Raises `kestrel.decode.model.UnsupportedModelError` for a model the decode path
        lacks."""
        from kestrel.decode.generate import Generator
        from kestrel.training.grpo.rollout import decode_completions

        deadline = None if seconds is None else time.perf_counter() + seconds
        was_training = model.training
        model.eval()
        longest = max(len(c.ids) for c in self.cases)
        # One batch of at most MAX_NEW_TOKENS steps never repays compiling the step: the step is
        # captured as a CUDA graph either way, so compiling can at best shorten the decode itself
        # (a few seconds in all on an 8B model), while it costs more than that in tracing and code
        # generation (bench/RESULTS.md, DPO evaluation). GRPO passes its own generator, compiled once
        # for thousands of rollout steps.
        generator = self.generator or Generator(model, tokenizer, max_seq_len=longest + self.max_new_tokens,
                                                compile=False)
        try:
            tokens, finished = self.answer(generator, getattr(model, "active_adapter", None), deadline)
            answers = decode_completions(tokenizer, tokens, generator.stop_ids)
        finally:
            # Ours: the model's projections get their own storage back. The run's: its cache goes.
            generator.close() if self.generator is None else generator.release()
            model.train(was_training)
        return self.write(answers, output_dir, step, finished, seconds)

    def answer(self, generator: Any, adapter: str | None,
               deadline: float | None) -> tuple[list[list[int]], list[str]]:
        """Each prompt's new tokens and why its answer ended ("stop", "length", or "time": still
        decoding when the deadline came, a `time.perf_counter()` reading; None: no deadline).

        Decoding stops at the chunk after which the next one would end past the deadline, judged
        by how long the last chunk took to arrive (chunks are equal in steps, so equal in time),
        rather than at the first chunk past it, which overran by up to a chunk."""
        tokens: list[list[int]] = [[] for _ in self.cases]
        reasons: list[str | None] = [None] * len(self.cases)
        chunks = generator.chunks([c.ids for c in self.cases], max_new_tokens=self.max_new_tokens, adapter=adapter)
        last, gap = time.perf_counter(), 0.0  # the first chunk is the prefill's: its time says nothing of the next
        try:
            for n, chunk in enumerate(chunks):  # the first chunk is always kept: every prompt gets an answer
                for row, new in zip(tokens, chunk.tokens):
                    row += new
                reasons = list(chunk.reasons)
                now = time.perf_counter()
                gap, last = (now - last if n else 0.0), now
                if deadline is not None and now + gap > deadline:
                    break
        finally:
            chunks.close()  # ends the request now, not when collected: the generator is free for release()
        return tokens, [r or "time" for r in reasons]  # still decoding at the deadline: "time"

    def write(self, answers: list[str], output_dir: Path, step: int, finished: list[str],
              seconds: float | None) -> dict[str, Any]:
        """Score `answers` (one per case; `finished`: why each ended) against the references and
        write GENERATION_FILE with the time budget `seconds`; returns what was written."""
        rows = [{"line": c.line, "prompt": c.prompt, "reference": c.reference, "answer": a.strip(), "finished": f,
                 "exact_match": exact_match(a, c.reference), "rouge_l": rouge_l(a, c.reference)["f"]}
                for c, a, f in zip(self.cases, answers, finished)]
        summary = {"step": step, "exact_match": sum(r["exact_match"] for r in rows) / len(rows),
                   "rouge_l": sum(r["rouge_l"] for r in rows) / len(rows), "seconds": seconds,
                   "stopped_early": sum(r["finished"] == "time" for r in rows), "rows": rows}
        (Path(output_dir) / GENERATION_FILE).write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
        return summary
