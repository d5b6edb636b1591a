"""Regenerates the shipped sample datasets and the demo tokenizer (deterministic, offline).

    python assets/make_assets.py

Everything it writes is committed; run it only when changing the samples.

The arithmetic samples cover every single-digit fact: `a + b` and `a x b` for a, b in 0..9, and
`(a + b) - b`, 300 facts in all. A number is one token, and a model as small as the demo (3.4M
parameters) does not learn to add in minutes, so the samples are small enough to be learned whole:
- `arithmetic_chat` (SFT, 800 rows) holds each fact at least twice, in a random one of the
  `WORDINGS`, with a worked answer ("3 + 4 = 7. The answer is 7."); assets/configs/demo_sft.yaml
  teaches the demo model almost all of it in about 100 s of CPU time.
- `arithmetic_prompts` (GRPO, prompt + answer) asks every fact once in one of the `NEW_WORDINGS`,
  which SFT never shows: the SFT model gets about half of them right, the reward teaches the rest
  (assets/configs/demo_grpo.yaml).
- `arithmetic_sharegpt` (200 rows) is the SFT kind of row in ShareGPT's layout.
- `arithmetic_preferences` (DPO, ORPO, SimPO: prompt, chosen, rejected) asks every fact once; the
  chosen answer is the worked right one, the rejected one the same working with a wrong value
  (off by 1 to 3). `arithmetic_kto` (prompt, completion, label) holds each fact once, right
  (label true) or wrong (false) at random. Their own random stream: the other samples stay as shipped.

The demo tokenizer is a byte-level BPE with ChatML special tokens and chat template, trained on the
first release of the samples (numbers 0..99; `_first_release`). Those texts are still generated,
never written, so the tokenizer and the word samples (which come from the same random stream) stay
exactly as shipped: retraining the tokenizer on other text would change the demo model's
vocabulary (`assets/demo/config.json`) and every demo model already on disk.
"""

from __future__ import annotations

import csv
import io
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

# --- arithmetic samples ----------------------------------------------------------------------

WORDINGS = {  # the SFT samples' questions
    "+": ["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}."],
    "-": ["What is {a} - {b}?", "Compute {a} - {b}.", "Subtract {b} from {a}."],
    "x": ["What is {a} times {b}?", "Compute {a} x {b}.", "Multiply {a} by {b}."],
}
NEW_WORDINGS = {  # the GRPO prompts' questions: wordings the SFT samples never use
    "+": ["What is {a} plus {b}?", "What is {a} and {b} together?", "What is the sum of {a} and {b}?"],
    "-": ["What is {a} minus {b}?", "What is {a} less {b}?", "What is the difference of {a} and {b}?",
          "Take {b} away from {a}."],
    "x": ["What is {a} multiplied by {b}?", "Multiply {a} and {b}."],
}

Fact = tuple[str, int, int, int]  # (sign, a, b, value)


def facts() -> list[Fact]:
    """Every single-digit sum and product, and each sum's inverse difference: 300 facts."""
    out = []
    for a in range(10):
        for b in range(10):
            out += [("+", a, b, a + b), ("-", a + b, b, a), ("x", a, b, a * b)]
    return out


def ask(fact: Fact, rng: random.Random, wordings: dict[str, list[str]] = WORDINGS) -> tuple[str, str, str]:
    """(question in a random wording, worked answer, answer value) for one fact."""
    sign, a, b, value = fact
    question = rng.choice(wordings[sign]).format(a=a, b=b)
    return question, f"{a} {sign} {b} = {value}. The answer is {value}.", str(value)


def chat_facts(rng: random.Random, rows: int = 800) -> list[Fact]:
    """Every fact twice, the rest of the rows drawn at random, shuffled."""
    every = facts()
    chosen = every * 2 + [rng.choice(every) for _ in range(rows - 2 * len(every))]
    rng.shuffle(chosen)
    return chosen


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def arithmetic_samples() -> dict[str, str]:
    """File name -> text of the three arithmetic samples (chat, sharegpt, GRPO prompts)."""
    rng = random.Random(2024)
    chat = []
    for fact in chat_facts(rng):
        q, a, _ = ask(fact, rng)
        chat.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    sharegpt = []
    for _ in range(200):
        q, a, _ = ask(rng.choice(facts()), rng)
        sharegpt.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    prompts = []
    for fact in rng.sample(facts(), len(facts())):  # every fact once, shuffled
        q, _, value = ask(fact, rng, NEW_WORDINGS)
        prompts.append({"prompt": q, "answer": value})
    return {"arithmetic_chat.jsonl": _jsonl(chat), "arithmetic_sharegpt.jsonl": _jsonl(sharegpt),
            "arithmetic_prompts.jsonl": _jsonl(prompts)}


def _wrong(value: int, rng: random.Random) -> int:
    """A plausible wrong value: off by 1 to 3, never negative."""
    return rng.choice([v for v in range(value - 3, value + 4) if v != value and v >= 0])


def preference_samples() -> dict[str, str]:
    """File name -> text of the paired (DPO) and unpaired (KTO) arithmetic preference samples."""
    rng = random.Random(2025)
    pairs, kto = [], []
    for fact in rng.sample(facts(), len(facts())):
        q, right, _ = ask(fact, rng)
        sign, a, b, value = fact
        bad = _wrong(value, rng)
        wrong = f"{a} {sign} {b} = {bad}. The answer is {bad}."
        pairs.append({"prompt": q, "chosen": right, "rejected": wrong})
        good = rng.random() < 0.5
        kto.append({"prompt": q, "completion": right if good else wrong, "label": good})
    return {"arithmetic_preferences.jsonl": _jsonl(pairs), "arithmetic_kto.jsonl": _jsonl(kto)}


# --- the first release: word samples and the tokenizer's corpus -------------------------------

_FIRST_QUESTIONS = [
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Add {a} and {b}.",
    "What is {a} - {b}?",
    "Subtract {b} from {a}.",
    "What is {a} times {b}?",
]


def _first_arith(rng: random.Random) -> tuple[str, str, int]:
    kind = rng.randrange(len(_FIRST_QUESTIONS))
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if kind in (3, 4):
        a, b = max(a, b), min(a, b)
        value, sign = a - b, "-"
    elif kind == 5:
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        value, sign = a * b, "x"
    else:
        value, sign = a + b, "+"
    question = _FIRST_QUESTIONS[kind].format(a=a, b=b)
    answer = f"{a} {sign} {b} = {value}. The answer is {value}."
    return question, answer, value


_WORDS = "apple river stone cloud garden pencil rocket silver window yellow orange tiger".split()
_TASKS = [
    ("Reverse the word.", lambda w: w[::-1]),
    ("Write the word in capital letters.", lambda w: w.upper()),
    ("Spell the word with dashes between the letters.", lambda w: "-".join(w)),
    ("How many letters does the word have?", lambda w: f"It has {len(w)} letters."),
]


def _first_release() -> dict[str, str]:
    """File name -> text of every sample as first shipped, from one random stream."""
    rng = random.Random(1234)
    chat = []
    for _ in range(800):
        q, a, _ = _first_arith(rng)
        chat.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    alpaca = []
    for _ in range(300):
        (task, fn), word = rng.choice(_TASKS), rng.choice(_WORDS)
        alpaca.append({"instruction": task, "input": word, "output": fn(word)})
    sharegpt = []
    for _ in range(200):
        q, a, _ = _first_arith(rng)
        sharegpt.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    table = io.StringIO(newline="")
    w = csv.writer(table)
    w.writerow(["prompt", "completion"])
    for _ in range(200):
        (task, fn), word = rng.choice(_TASKS), rng.choice(_WORDS)
        w.writerow([f"{task} {word}", fn(word)])
    prompts = []
    for _ in range(400):
        q, _, value = _first_arith(rng)
        prompts.append({"prompt": q, "answer": str(value)})
    return {"arithmetic_chat.jsonl": _jsonl(chat), "words_alpaca.json": json.dumps(alpaca, indent=1),
            "arithmetic_sharegpt.jsonl": _jsonl(sharegpt), "words_prompt_completion.csv": table.getvalue(),
            "arithmetic_prompts.jsonl": _jsonl(prompts)}


def write_samples() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    first = _first_release()
    files = {name: first[name] for name in ("words_alpaca.json", "words_prompt_completion.csv")}
    files.update(arithmetic_samples())
    files.update(preference_samples())
    for name, text in files.items():
        with open(DATA / name, "w", newline="") as f:
            f.write(text)


def _corpus() -> list[str]:
    lines = []
    for text in _first_release().values():
        lines.extend(text.splitlines())
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
