"""Chat formats and the Ollama `Modelfile` written beside a GGUF file.

    fmt = detect_chat_format(tokenizer.chat_template)   # "chatml", "llama3", "gemma", "gemma4", "mistral", "harmony" or None
    text = modelfile("model-q4_k_m.gguf", fmt, stops=end_of_turn_tokens(fmt, tokenizer))

The `TEMPLATE` is a Go template (Ollama's language) that renders a conversation the way the
model's Jinja chat template does, ending with the header that opens the assistant's turn; BOS is
not written since Ollama's tokenizer adds it. One `PARAMETER stop` per end-of-turn token, so
generation ends where the model ends its turn. An unknown chat format gets no TEMPLATE: Ollama
then reads the Jinja template embedded in the GGUF.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kestrel.decode.chat import HARMONY_END_OF_TURN


@dataclass(frozen=True)
class ChatFormat:
    name: str
    markers: tuple[str, ...]  # all present in a Jinja template of this format
    end_of_turn: tuple[str, ...]  # tokens that close a turn, the first being the usual one
    go_template: str | None  # None: Ollama renders the Jinja template embedded in the GGUF


CHATML = ChatFormat(
    "chatml", ("<|im_start|>", "<|im_end|>"), ("<|im_end|>",),
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
)
LLAMA3 = ChatFormat(
    "llama3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), ("<|eot_id|>", "<|eom_id|>"),
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
)
GEMMA = ChatFormat(
    "gemma", ("<start_of_turn>", "<end_of_turn>"), ("<end_of_turn>",),
    "{{- range .Messages }}<start_of_turn>{{ if eq .Role \"assistant\" }}model{{ else }}user{{ end }}\n"
    "{{ .Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n",
)
# Gemma 4: `<|turn>{role}\n...<turn|>\n` (assistant as model, system kept), the reply opened with an
# empty thought channel (thinking off, its template's default).
GEMMA4 = ChatFormat(
    "gemma4", ("<|turn>", "<turn|>"), ("<turn|>",),
    "{{- range .Messages }}<|turn>{{ if eq .Role \"assistant\" }}model{{ else }}{{ .Role }}{{ end }}\n"
    "{{ .Content }}<turn|>\n{{ end }}<|turn>model\n<|channel>thought\n<channel|>",
)
MISTRAL = ChatFormat(
    "mistral", ("[INST]", "[/INST]"), (),  # a turn ends with EOS, added from the tokenizer
    "{{- range .Messages }}{{ if eq .Role \"user\" }}[INST] {{ .Content }} [/INST]"
    "{{ else if eq .Role \"assistant\" }}{{ .Content }}</s>{{ end }}{{ end }}",
)
# gpt-oss's harmony: `<|start|>{role}<|message|>...<|end|>`, the assistant's reply on channels
# (`<|channel|>final<|message|>`) ending in <|return|> (or <|call|> for a tool call). Its system
# header (reasoning effort, dates, tools) is the Jinja template's: no Go template stands in for it.
HARMONY = ChatFormat("harmony", ("<|start|>", "<|message|>", "<|end|>"), HARMONY_END_OF_TURN, None)
FORMATS = {f.name: f for f in (CHATML, LLAMA3, GEMMA, GEMMA4, MISTRAL, HARMONY)}


def detect_chat_format(template: str | None) -> str | None:
    """The chat format a Jinja chat template writes, from the special tokens it contains."""
    if not template:
        return None
    for fmt in FORMATS.values():
        if all(marker in template for marker in fmt.markers):
            return fmt.name
    return None


def end_of_turn_tokens(format_name: str | None, tokenizer: Any) -> list[str]:
    """The tokens that end the assistant's turn: the format's own, then EOS, those in the vocab."""
    vocab = tokenizer.get_vocab()
    candidates = list(FORMATS[format_name].end_of_turn) if format_name else []
    if tokenizer.eos_token:
        candidates.append(tokenizer.eos_token)
    stops: list[str] = []
    for text in candidates:
        if text in vocab and text not in stops:
            stops.append(text)
    return stops


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def modelfile(gguf_name: str, format_name: str | None, stops: list[str]) -> str:
    """The Modelfile's text: FROM the GGUF beside it, TEMPLATE for a known format, the stops."""
    lines = [f"FROM ./{gguf_name}", ""]
    if format_name and FORMATS[format_name].go_template:
        # Triple quotes hold the template verbatim (newlines included); it never contains them.
        lines += [f'TEMPLATE """{FORMATS[format_name].go_template}"""', ""]
    lines += [f"PARAMETER stop {_quote(s)}" for s in stops]
    return "\n".join(lines) + "\n"
