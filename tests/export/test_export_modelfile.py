"""Ollama Modelfiles: the Go TEMPLATE of each chat format renders what the Jinja chat template
renders (through a small renderer of the Go template subset the templates use), and the stops
are the end-of-turn tokens."""

from __future__ import annotations

import re

import pytest

from tests.support.export_fixtures import CHATML, GEMMA, GEMMA4, LLAMA3, MISTRAL, train_tokenizer
from kestrel.export.modelfile import FORMATS, detect_chat_format, end_of_turn_tokens, modelfile

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def _parse(template: str) -> list:
    """Go template text into nodes: ("text", s), ("var", field), ("range", body), ("if", branches, else)."""
    tokens: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        text = text.lstrip() if trim_next else text
        tokens.append(("text", text.rstrip() if m.group(1) else text))
        tokens.append(("act", m.group(2)))
        pos, trim_next = m.end(), bool(m.group(3))
    tail = template[pos:]
    tokens.append(("text", tail.lstrip() if trim_next else tail))
    nodes, i, stop = _block(tokens, 0)
    assert stop is None and i == len(tokens)
    return nodes


def _block(tokens: list, i: int) -> tuple[list, int, str | None]:
    nodes: list = []
    while i < len(tokens):
        kind, value = tokens[i]
        i += 1
        if kind == "text":
            nodes.append(("text", value))
        elif value == "end" or value.startswith("else"):
            return nodes, i, value
        elif value == "range .Messages":
            body, i, stop = _block(tokens, i)
            assert stop == "end"
            nodes.append(("range", body))
        elif value.startswith("if "):
            branches, cond = [], value[3:]
            while True:
                body, i, stop = _block(tokens, i)
                branches.append((cond, body))
                if stop == "end":
                    nodes.append(("if", branches, []))
                    break
                if stop == "else":
                    other, i, stop = _block(tokens, i)
                    assert stop == "end"
                    nodes.append(("if", branches, other))
                    break
                cond = stop[len("else if "):]
        else:
            assert value in (".Role", ".Content"), f"unsupported action {value!r}"
            nodes.append(("var", value[1:]))
    return nodes, i, None


def _cond(cond: str, message: dict) -> bool:
    m = re.fullmatch(r'eq \.Role "(\w+)"', cond)
    assert m, f"unsupported condition {cond!r}"
    return message["role"] == m.group(1)


def _render(nodes: list, messages: list[dict], message: dict | None = None) -> str:
    out = []
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "var":
            out.append(message["role" if node[1] == "Role" else "content"])
        elif node[0] == "range":
            out.extend(_render(node[1], messages, m) for m in messages)
        else:
            taken = next((body for cond, body in node[1] if _cond(cond, message)), node[2])
            out.append(_render(taken, messages, message))
    return "".join(out)


def test_renderer_follows_go_trim_rules() -> None:
    assert _render(_parse("a \n{{- range .Messages }} {{ .Role -}} \n x{{ end }}"), [{"role": "u", "content": ""}]) == "a ux"


CASES = {
    "chatml": ("gpt2", CHATML, True),
    "llama3": ("llama3", LLAMA3, True),
    "gemma": ("gemma", GEMMA, False),  # Gemma folds a system message into the first user turn
    "gemma4": ("gemma4", GEMMA4, True),  # Gemma 4 keeps a system turn; the reply opens an empty thought channel
    "mistral": ("mistral", MISTRAL, False),  # this Mistral template drops system messages
}
TURNS = [
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "12 + 7 = 19."},
    {"role": "user", "content": "And 3 + 4?"},
]


@pytest.mark.parametrize("name", list(CASES))
def test_go_template_renders_like_the_chat_template(name: str) -> None:
    style, template, system = CASES[name]
    tokenizer = train_tokenizer(style, 400)
    assert tokenizer.chat_template == template and detect_chat_format(template) == name
    messages = ([{"role": "system", "content": "Be brief."}] if system else []) + TURNS
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if tokenizer.bos_token and expected.startswith(tokenizer.bos_token):
        expected = expected[len(tokenizer.bos_token):]  # Ollama's tokenizer adds BOS itself
    if name == "mistral":  # no generation header: the prompt ends after [/INST]
        assert expected.endswith("[/INST]")
    assert _render(_parse(FORMATS[name].go_template), messages) == expected


@pytest.mark.parametrize("name,stops", [("chatml", ["<|im_end|>"]), ("llama3", ["<|eot_id|>"]),
                                        ("gemma", ["<end_of_turn>", "<eos>"]), ("gemma4", ["<turn|>", "<eos>"]),
                                        ("mistral", ["</s>"])])
def test_stops_are_the_end_of_turn_tokens(name: str, stops: list[str]) -> None:
    tokenizer = train_tokenizer(CASES[name][0], 400)
    assert end_of_turn_tokens(name, tokenizer) == stops
    text = modelfile("m-q4_k_m.gguf", name, stops)
    lines = text.splitlines()
    assert lines[0] == "FROM ./m-q4_k_m.gguf"
    assert [line for line in lines if line.startswith("PARAMETER")] == [f'PARAMETER stop "{s}"' for s in stops]
    body = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert body == FORMATS[name].go_template


def test_unknown_chat_format_gets_no_template() -> None:
    assert detect_chat_format("{{ messages[0]['content'] }}") is None
    assert detect_chat_format(None) is None
    text = modelfile("m.gguf", None, ["<eos>"])
    assert "TEMPLATE" not in text and 'PARAMETER stop "<eos>"' in text


def test_quotes_in_stops_are_escaped() -> None:
    assert 'PARAMETER stop "a\\"b"' in modelfile("m.gguf", None, ['a"b'])


def test_harmony_format_stops_at_return_and_call_and_keeps_the_jinja_template() -> None:
    """gpt-oss's harmony: detected from its markers, stops at <|return|> and <|call|>, and no Go
    template (Ollama renders the embedded Jinja, which writes harmony's system header)."""
    tokenizer = train_tokenizer("llama3", 400)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|channel|>"]})
    template = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
    assert detect_chat_format(template) == "harmony"
    stops = end_of_turn_tokens("harmony", tokenizer)
    assert stops[:2] == ["<|return|>", "<|call|>"]
    text = modelfile("m.gguf", "harmony", stops)
    assert "TEMPLATE" not in text and 'PARAMETER stop "<|return|>"' in text and 'PARAMETER stop "<|call|>"' in text
