"""`python -m kestrel chat MODEL`: talk to a model (and its LoRA adapter) from the terminal.

    python -m kestrel chat demo --prompt "What is 2 + 3?" --temperature 0   # prints the answer only
    python -m kestrel chat ./models/llama --adapter ./runs/sft/adapter      # interactive

With `--prompt` the chat template is applied to that one user message, only the completion is
printed (streamed) and the command exits. Without it, an interactive chat keeps the
conversation; `/base` and `/adapter` switch between the base model and the adapter on the
same loaded weights, `/reset` forgets the conversation, `/exit` or Ctrl-D quits.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

ADAPTER_NAME = "adapter"
HELP = "/base, /adapter: switch model  /reset: new conversation  /exit: quit"


def add_chat_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `chat` subcommand on `subparsers` (from `ArgumentParser.add_subparsers`)."""
    p = subparsers.add_parser("chat", help="chat with a model, or answer one --prompt and exit")
    p.add_argument("model", help="a local model folder, a Hugging Face hub id, or `demo`")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter folder, applied unmerged")
    p.add_argument("--prompt", help="answer this one message and exit (prints only the completion)")
    p.add_argument("--system", help="a system message placed before the conversation")
    p.add_argument("--max-new-tokens", type=int, default=512, help="the most tokens one answer may have")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (deterministic)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens under min_p x the top one; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="makes sampling repeatable")
    p.add_argument("--max-seq-length", type=int, default=4096, help="prompt + answer, in tokens")
    p.add_argument("--load-in-4bit", action="store_true", help="NF4 base weights (needs CUDA)")
    p.set_defaults(handler=run_chat)
    return p


def run_chat(args: argparse.Namespace) -> int:
    """Load the model, then answer `--prompt` or run the interactive loop. Returns the exit code."""
    from kestrel.decode import Generator, SamplingParams
    from kestrel.model.loader import load

    model, tokenizer = load(args.model, args.max_seq_length, load_in_4bit=args.load_in_4bit, patch=False)
    gen = Generator(model, tokenizer, max_seq_len=args.max_seq_length)
    adapter = None
    if args.adapter:
        gen.load_adapter(args.adapter, ADAPTER_NAME)
        adapter = ADAPTER_NAME
    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed,
    )
    system = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        _answer(gen, system + [{"role": "user", "content": args.prompt}], args.max_new_tokens, sampling, adapter)
        return 0
    return _interactive(gen, system, args, sampling, adapter)


def _answer(gen: Any, messages: list[dict[str, str]], max_new: int, sampling: Any, adapter: str | None) -> str:
    """Stream one answer to stdout; returns its text."""
    from kestrel.decode import encode_chat

    ids = encode_chat(gen.tokenizer, messages)
    pieces = []
    for piece in gen.stream(ids, max_new_tokens=max_new, sampling=sampling, adapter=adapter):
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces)


def _interactive(
    gen: Any, system: list[dict[str, str]], args: argparse.Namespace, sampling: Any, adapter: str | None
) -> int:
    loaded = adapter
    history: list[dict[str, str]] = []
    print(f"Kestrel chat with {args.model}{f' + {loaded}' if loaded else ''}. {HELP}", file=sys.stderr)
    while True:
        try:
            label = f"[{adapter or 'base'}] " if loaded else ""
            line = input(f"{label}you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line.startswith("/") or not line:
            adapter, history = _command(line, adapter, loaded, history)
            continue
        history.append({"role": "user", "content": line})
        while len(history) > 2 and _too_long(gen, system + history, args.max_new_tokens):
            history = history[2:]  # forget the oldest exchange
        try:
            reply = _answer(gen, system + history, args.max_new_tokens, sampling, adapter)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})


def _command(line: str, adapter: str | None, loaded: str | None, history: list) -> tuple[str | None, list]:
    """A slash command -> (the adapter to use next, the conversation to keep)."""
    if line == "/reset":
        return adapter, []
    if line == "/base":
        return None, history
    if line == "/adapter":
        if loaded is None:
            print("no --adapter was loaded", file=sys.stderr)
        return loaded, history
    if line:
        print(HELP, file=sys.stderr)
    return adapter, history


def _too_long(gen: Any, messages: list[dict[str, str]], max_new: int) -> bool:
    from kestrel.decode import encode_chat

    return len(encode_chat(gen.tokenizer, messages)) + min(max_new, 256) > gen.max_seq_len
