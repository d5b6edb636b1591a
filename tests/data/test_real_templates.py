"""Training tokenization under the real chat templates (the ones llama.cpp's vocabulary files of
Qwen 2/3, Qwen 3.5, Gemma 4 and Phi-3 carry; tests.support.real_vocab): with
train_on_responses_only, each assistant answer and the end-of-turn text after it are trained,
everything the user or system wrote and every role header is masked. Skipped until ./install.sh
has fetched the vocabularies."""

from __future__ import annotations

import pytest

from kestrel.data.formats import Conversation
from kestrel.data.tokenize import IGNORE, tokenize_conversation
from tests.support.real_vocab import INEXACT

CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And the capital of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
]
# Kestrel bug, in kestrel.data.tokenize.assistant_spans (not this branch's room): an answer's span
# starts where the history rendered with add_generation_prompt=True ends, but Gemma 4's generation
# prompt ends in an empty thinking channel ("<|turn>model\n<|channel>thought\n<channel|>") that the
# rendered conversation does not hold, so the first 27 characters of every answer are masked.
GEMMA4_SPAN = "Gemma 4's generation prompt adds an empty thinking channel the history lacks: answers' starts are masked"
WITH_TEMPLATE = ("qwen2", "qwen35", pytest.param("gemma-4", marks=pytest.mark.xfail(reason=GEMMA4_SPAN, strict=True)),
                 pytest.param("phi-3", marks=pytest.mark.xfail(reason=INEXACT["phi-3"], strict=True)))  # the vocabulary files that carry a chat template


def _trained_runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for k, (token, label) in enumerate(zip(ids, labels)):
        if label == IGNORE:
            continue
        if k == 0 or labels[k - 1] == IGNORE:
            runs.append([])
        runs[-1].append(token)
    return runs


@pytest.mark.parametrize("name", WITH_TEMPLATE)
def test_real_template_trains_answers_and_masks_prompts(name: str, real_vocab) -> None:
    tokenizer = real_vocab(name).tokenizer
    assert tokenizer.chat_template, f"{name}: the vocabulary file should carry a chat template"
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    sample = tokenize_conversation(tokenizer, Conversation(messages=CONVERSATION), 4096, responses_only=True)
    runs = [tokenizer.decode(run) for run in _trained_runs(sample.input_ids, sample.labels)]
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert len(runs) == len(answers), runs
    for text, answer in zip(runs, answers):
        assert answer in text, (answer, text)
        before, after = text.split(answer, 1)
        assert before.strip() == "", f"{name}: trained text before the answer (a role header?): {before!r}"
        # the end-of-turn marker is trained (the model learns to stop): exactly what the template writes next
        assert after.strip() and full[full.index(answer) + len(answer):].startswith(after), (name, after)
