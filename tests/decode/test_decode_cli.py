"""`python -m kestrel chat` on the built-in demo model (CPU): --prompt, --adapter, interactive."""

from __future__ import annotations

import argparse
import copy
import io
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from kestrel.cli.chat import add_chat_parser
from kestrel.decode import encode_chat, stop_token_ids
from kestrel.model.loader import load
from tests.decode.test_decode_hf import _one_thread  # noqa: F401  (autouse: one CPU thread)

QUESTION = "What is 2 + 3? 🎉"


def _chat(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_chat_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chat", *argv])
    return args.handler(args)


def _reference(model, tokenizer, n: int) -> str:
    """What HF greedy `generate` answers, decoded the way the CLI prints it."""
    ids = encode_chat(tokenizer, [{"role": "user", "content": QUESTION}])
    stops = stop_token_ids(tokenizer, model.generation_config)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=stops,
                             pad_token_id=stops[0])
    new = [t for t in out[0, len(ids) :].tolist() if t not in stops]
    return tokenizer.decode(new, skip_special_tokens=True)


def test_prompt_prints_only_the_greedy_completion(capsys) -> None:
    assert _chat(["demo", "--prompt", QUESTION, "--max-new-tokens", "24", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    model, tokenizer = load("demo", 256, patch=False)
    assert printed == _reference(model, tokenizer, 24) + "\n"


def test_prompt_with_an_adapter_folder(tmp_path: Path, capsys) -> None:
    model, tokenizer = load("demo", 256, patch=False)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    peft.save_pretrained(tmp_path / "adapter")
    expected = _reference(peft.eval(), tokenizer, 24)
    with peft.disable_adapter():
        assert expected != _reference(peft, tokenizer, 24)  # the adapter changes the answer
    argv = ["demo", "--adapter", str(tmp_path / "adapter"), "--prompt", QUESTION, "--max-new-tokens", "24",
            "--temperature", "0"]
    assert _chat(argv) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_interactive_chat_switches_and_quits(monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\n/help\nagain\n"))
    assert _chat(["demo", "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("\n") >= 2  # two answers, then end of input
    assert "/reset" in captured.err


def test_harmony_stops_at_the_reply_end_not_at_each_message_end(demo_tokenizer) -> None:
    """gpt-oss writes <|end|> after its reasoning message too: the reply stops at <|return|>/<|call|>."""
    tokenizer = copy.deepcopy(demo_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|start|>", "<|message|>", "<|channel|>", "<|end|>",
                                                                "<|return|>", "<|call|>"]})
    tokenizer.chat_template = ("{% for m in messages %}<|start|>{{ m['role'] }}<|channel|>final<|message|>"
                               "{{ m['content'] }}<|end|>{% endfor %}<|start|>assistant")
    stops = stop_token_ids(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["<|end|>", "<|return|>", "<|call|>"])
    assert ids[0] not in stops and ids[1] in stops and ids[2] in stops
