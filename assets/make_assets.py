"""Regenerates the shipped sample datasets and the demo tokenizer (deterministic, offline).

    python assets/make_assets.py

Everything it writes is committed; run it only when changing the samples. The demo tokenizer is a
byte-level BPE trained on the samples, with ChatML special tokens and chat template, so the
built-in demo model can learn the samples in minutes on a CPU.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
DATA = ASSETS / "datasets"
DEMO = ASSETS / "demo"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

_QUESTIONS = [
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Add {a} and {b}.",
    "What is {a} - {b}?",
    "Subtract {b} from {a}.",
    "What is {a} times {b}?",
]


def _arith(rng: random.Random) -> tuple[str, str, int]:
    kind = rng.randrange(len(_QUESTIONS))
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if kind in (3, 4):
        a, b = max(a, b), min(a, b)
        value, sign = a - b, "-"
    elif kind == 5:
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        value, sign = a * b, "x"
    else:
        value, sign = a + b, "+"
    question = _QUESTIONS[kind].format(a=a, b=b)
    answer = f"{a} {sign} {b} = {value}. The answer is {value}."
    return question, answer, value


_WORDS = "apple river stone cloud garden pencil rocket silver window yellow orange tiger".split()
_TASKS = [
    ("Reverse the word.", lambda w: w[::-1]),
    ("Write the word in capital letters.", lambda w: w.upper()),
    ("Spell the word with dashes between the letters.", lambda w: "-".join(w)),
    ("How many letters does the word have?", lambda w: f"It has {len(w)} letters."),
]


def write_samples() -> None:
    rng = random.Random(1234)
    DATA.mkdir(parents=True, exist_ok=True)
    with open(DATA / "arithmetic_chat.jsonl", "w") as f:
        for _ in range(800):
            q, a, _ = _arith(rng)
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    alpaca = []
    for _ in range(300):
        (task, fn), word = rng.choice(_TASKS), rng.choice(_WORDS)
        alpaca.append({"instruction": task, "input": word, "output": fn(word)})
    (DATA / "words_alpaca.json").write_text(json.dumps(alpaca, indent=1))
    with open(DATA / "arithmetic_sharegpt.jsonl", "w") as f:
        for _ in range(200):
            q, a, _ = _arith(rng)
            conv = [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
            f.write(json.dumps({"conversations": conv}) + "\n")
    with open(DATA / "words_prompt_completion.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion"])
        for _ in range(200):
            (task, fn), word = rng.choice(_TASKS), rng.choice(_WORDS)
            w.writerow([f"{task} {word}", fn(word)])
    with open(DATA / "arithmetic_prompts.jsonl", "w") as f:
        for _ in range(400):
            q, _, value = _arith(rng)
            f.write(json.dumps({"prompt": q, "answer": str(value)}) + "\n")


def _corpus() -> list[str]:
    lines = []
    for path in DATA.glob("*"):
        lines.extend(path.read_text().splitlines())
    lines += ["user", "assistant", "system", "The answer is", "You are a helpful assistant."]
    lines += [" ".join(map(str, range(i, i + 20))) for i in range(0, 200, 20)]
    return lines


def write_tokenizer(vocab_size: int = 1024) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        bos_token=None,
        model_max_length=2048,
    )
    fast.chat_template = CHATML_TEMPLATE
    DEMO.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(DEMO)


if __name__ == "__main__":
    write_samples()
    write_tokenizer()
    print("wrote", sorted(p.name for p in DATA.iterdir()), "and", sorted(p.name for p in DEMO.iterdir()))
