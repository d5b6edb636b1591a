"""Tiny models with locally trained tokenizers, in the styles of the real families, for the export
tests and the export benchmark (no download).

    tok = train_tokenizer("llama3", vocab_size=800)
    folder = save_tiny_model("llama", tok, tmp_path / "llama")

Tokenizer styles: byte-level BPE as GPT-2 (`gpt2`, the demo model's), Llama 3 (`llama3`) and
Qwen 2 (`qwen2`) split text, SentencePiece BPE with byte fallback as Mistral (`mistral`, space
prefix) and Gemma (`gemma`, no prefix; `gemma4`, Gemma 4's turn tokens) use it, trained with the
`sentencepiece` library, and a SentencePiece-style Unigram tokenizer (`unigram`, ChatML template).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from kestrel.export.gguf_tokenizer import _LLAMA3_RE, _QWEN2_RE
from kestrel.paths import SAMPLE_DATASETS

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (  # Gemma 3's: a system message becomes the start of the first user turn
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
    "(prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA4 = (  # Gemma 4's turns (its template's tools, media and thinking branches left out)
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<|turn>' + role + '\n' + message['content'] | trim + '<turn|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n<|channel>thought\n<channel|>' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

# style -> (special tokens, bos, eos, pad, chat template)
_STYLES: dict[str, tuple[list[str], str | None, str, str | None, str]] = {
    "gpt2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>", CHATML),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>", CHATML),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", LLAMA3),
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", None, MISTRAL),
    "gemma": (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<pad>", GEMMA),
    "gemma4": (["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|channel>", "<channel|>"], "<bos>", "<eos>",
               "<pad>", GEMMA4),
    "unigram": (["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"], "<s>", "<|im_end|>", None, CHATML),
}
STYLES = tuple(_STYLES)

# a style for each family, as the real models use them
FAMILY_STYLE = {"llama": "llama3", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen2", "gemma3_text": "gemma",
                "qwen3_moe": "qwen2", "gpt_oss": "llama3", "qwen3_5_text": "qwen2", "gemma4_text": "gemma4",
                "qwen3_5_moe_text": "qwen2"}

EXTRA_TEXT = [
    "Hello world. The quick brown fox jumps over the lazy dog 12345 times!",
    "héllo wörld, naïve café; ünïcödé and emoji 🙂 too.",
    "    indented code:\n\tdef f(x):\n\t\treturn x * 2  # comment\n",
    "What's the answer? It's 42. They'll see, we've done it, I'm sure.",
]


def corpus() -> list[str]:
    lines = list(EXTRA_TEXT)
    for path in sorted(SAMPLE_DATASETS.glob("*")):
        lines.extend(path.read_text().splitlines())
    return lines


def _byte_level(style: str, vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = _STYLES[style][0]
    tok = Tokenizer(models.BPE(ignore_merges=style == "llama3"))
    if style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        regex = _LLAMA3_RE if style == "llama3" else _QWEN2_RE
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return tok


def _unigram(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=_STYLES["unigram"][0], unk_token="<unk>")
    tok.train_from_iterator(corpus(), trainer)
    return tok


def _sentencepiece(style: str, vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train SentencePiece BPE (byte fallback) and read its pieces and merges (ordered by score)."""
    import sentencepiece as spm

    specials = _STYLES[style][0]
    ids = {
        "mistral": dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
        "gemma": dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>"),
        "gemma4": dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>"),
    }
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, num_threads=1,
        control_symbols=specials[sum(k.endswith('_id') and v >= 0 for k, v in ids[style].items()):], allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2,
        add_dummy_prefix=style == "mistral", **ids[style],
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    merges = []
    for piece, piece_id in sorted(vocab.items(), key=lambda kv: kv[1]):
        if sp.is_control(piece_id) or sp.is_byte(piece_id) or sp.is_unknown(piece_id):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((vocab[left], vocab[right], piece_id, (left, right)))
    merges.sort(key=lambda m: (m[2], m[0], m[1]))
    return vocab, [m[3] for m in merges]


def train_tokenizer(style: str, vocab_size: int = 600) -> Any:
    """A Hugging Face fast tokenizer of `style` (one of STYLES) with its chat template."""
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer, LlamaTokenizer, PreTrainedTokenizerFast

    specials, bos, eos, pad, template = _STYLES[style]
    if style in ("mistral", "gemma", "gemma4"):
        vocab, merges = _sentencepiece(style, vocab_size)
        cls = LlamaTokenizer if style == "mistral" else GemmaTokenizer
        kwargs = dict(unk_token="<unk>", bos_token=bos, eos_token=eos)
        if pad:
            kwargs["pad_token"] = pad
        fast = cls(vocab=vocab, merges=merges, **kwargs)
        fast.add_special_tokens({"additional_special_tokens": [AddedToken(s, special=True) for s in specials]})
        fast.add_bos_token = True  # SentencePiece models start every text with BOS
    elif style == "unigram":
        fast = PreTrainedTokenizerFast(tokenizer_object=_unigram(vocab_size), bos_token=bos, eos_token=eos,
                                       unk_token="<unk>")
    else:
        fast = PreTrainedTokenizerFast(tokenizer_object=_byte_level(style, vocab_size), bos_token=bos,
                                       eos_token=eos, pad_token=pad, unk_token=None)
        if style == "llama3":
            from tokenizers import processors

            fast.backend_tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, fast.convert_tokens_to_ids(bos))]
            )
    fast.chat_template = template
    return fast


def decisive(model: torch.nn.Module, logit_std: float = 6.0) -> torch.nn.Module:
    """Scale the final norm so logits spread by about `logit_std`: a random model's top-2 logits are
    otherwise nearly tied, and a tie flips on any rounding (f16 weights), which a test cannot tell
    from a wrong export. Trained models are decisive on their own."""
    from kestrel.model.multimodal import language_stack
    from kestrel.model.registry import family_for

    norm = language_stack(model)[1].norm
    offset = family_for(model.config).norm_offset  # Gemma 3 and Qwen3.5 scale by (1 + w)
    with torch.no_grad():
        ids = torch.arange(min(64, model.get_output_embeddings().weight.shape[0])).unsqueeze(0)
        std = model(ids).logits.float().std()
        factor = logit_std / max(float(std), 1e-6)
        norm.weight.add_(offset).mul_(factor).sub_(offset)
    return model


def lively(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-draw every projection inside the layers with variance-preserving scale (std 1/sqrt(in)):
    at Hugging Face's init (std 0.02) a tiny model's layers barely move the residual stream, so
    with tied embeddings its greedy tokens hardly depend on them, and a wrong layer layout in an
    export would go unnoticed. A mixture of experts' stacked experts (E, out, in), router (E, H) and
    shared-expert gate (1, H) are re-drawn too, so routing and every expert matter."""
    from kestrel.model.registry import family_for

    moe = family_for(model.config).moe
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".layers." not in name:
                continue
            if param.dim() == 2 and name.endswith(("proj.weight", "mlp.gate.weight", "shared_expert_gate.weight")):
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif moe is not None and param.dim() == 3 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                fan_in = param.shape[1] if moe.transposed else param.shape[2]
                param.copy_(torch.randn(param.shape, generator=gen) / fan_in ** 0.5)
    return model


def save_tiny_model(model_type: str, tokenizer: Any, folder: Path, seed: int = 0,
                    dtype: torch.dtype = torch.float32, layers_matter: bool = False, **overrides: Any) -> Path:
    """A tiny random `model_type` model sized to `tokenizer`, saved with it to `folder`;
    `layers_matter`: its layers' projections drawn by `lively`."""
    from tests.support.tiny import tiny_model

    model = tiny_model(model_type, vocab_size=len(tokenizer), seed=seed, **overrides)
    model = decisive(lively(model, seed) if layers_matter else model)
    return _save(model, tokenizer, folder, dtype)


def save_tiny_image_text_model(kind: str, tokenizer: Any, folder: Path, seed: int = 0) -> Path:
    """A tiny random image-text model (`tests.support.tiny_image_text.IMAGE_TEXT`) sized to `tokenizer`."""
    from tests.support.tiny_image_text import tiny_image_text_model

    return _save(decisive(tiny_image_text_model(kind, len(tokenizer), seed=seed)), tokenizer, folder, torch.float32)


def _save(model: torch.nn.Module, tokenizer: Any, folder: Path, dtype: torch.dtype) -> Path:
    ids = {k: getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        for key, value in ids.items():
            setattr(config, f"{key}_token_id", value)
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = ids["bos"], ids["eos"]
    model.to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
