"""GGUF export on the real vocabularies of the families (llama.cpp's ggml-vocab files, converted to
Hugging Face tokenizers by transformers: tests.support.real_vocab). Skipped until ./install.sh
has fetched them.

The conversion itself is checked first against llama.cpp's own test strings and ids; where
transformers' conversion is not exact the test says why (strict xfail: it fails loudly once a
transformers release fixes it). The export tests need only that the converted tokenizer is a
consistent tokenizer of that vocabulary: llama.cpp must tokenize like it after export.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kestrel.errors import KestrelError
from kestrel.export import export
from kestrel.export.check import check_tokenizer
from kestrel.export.gguf_export import settle_tokenizer
from kestrel.export.gguf_tokenizer import build_vocab
from kestrel.export.gguf_writer import write_gguf
from kestrel.export.source import resolve_source
from kestrel.model.registry import GGUF_FAMILIES
from tests.support.export_fixtures import LLAMA3, MISTRAL, save_tiny_model
from tests.support.real_vocab import INEXACT, VOCABS


# family -> the vocabulary of its real models
FAMILY_VOCAB = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "mistral": "llama-spm",
                "qwen3_5_text": "qwen35", "gemma4_text": "gemma-4", "qwen3_5_moe_text": "qwen35"}
# the real template of a family whose vocabulary file carries none
TEMPLATE = {"llama-bpe": LLAMA3, "llama-spm": MISTRAL}
# tiny but with the real vocabulary: the embedding (vocab x 64) is most of the model
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def _vocab_param(name: str):
    marks = [pytest.mark.xfail(reason=INEXACT[name], strict=True)] if name in INEXACT else []
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_vocab_param(n) for n in VOCABS])
def test_converted_tokenizer_gives_llama_cpp_test_ids(name: str, real_vocab) -> None:
    vocab = real_vocab(name)
    wrong = [(text[:30], ids[:6], vocab.tokenizer(text, add_special_tokens=False)["input_ids"][:6])
             for text, ids in vocab.cases if vocab.tokenizer(text, add_special_tokens=False)["input_ids"] != ids]
    assert not wrong, f"{len(wrong)} of {len(vocab.cases)}: {wrong[:3]}"


# transformers' conversion of Gemma 4's vocabulary gives "\t" to two ids, which the export refuses
# (test_token_text_on_two_ids_is_refused_before_llama_cpp_aborts): no real Gemma 4 tokenizer to export
UNEXPORTABLE = {"gemma4_text": "the converted Gemma 4 vocabulary has a duplicate token text, which the export refuses"}


def _family_param(family: str):
    reason = UNEXPORTABLE.get(family) or (None if family in GGUF_FAMILIES else f"no GGUF export of {family} yet")
    return pytest.param(family, marks=[pytest.mark.skip(reason=reason)] if reason else [])


@pytest.mark.parametrize("family", [_family_param(f) for f in FAMILY_VOCAB])
def test_f16_export_on_the_real_vocabulary(family: str, real_vocab, tmp_path: Path) -> None:
    """llama.cpp tokenizes the test strings and chat prompts as Hugging Face does, gives its greedy
    tokens, and carries the chat template."""
    name = FAMILY_VOCAB[family]
    tokenizer = real_vocab(name).tokenizer
    if not tokenizer.chat_template:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = TEMPLATE[name]
    folder = save_tiny_model(family, tokenizer, tmp_path / family, **SMALL)
    result = export(folder, "gguf", tmp_path / "out", quant="f16")
    checks = result.checks
    assert result.passed, result.summary()
    assert checks["tokenizer"]["passed"], checks["tokenizer"]
    f16 = checks["gguf_f16"]
    assert f16.passed and f16.exact_required and f16.prompt_top1_agreement == 1.0, f16
    assert checks["chat_template"]["embedded"] and checks["chat_template"]["jinja_matches"], checks["chat_template"]
    # llama.cpp's own test strings, on the exported file: plain (BOS/EOS as the tokenizer adds them) and chat-rendered
    texts = _unchanged_by_normalizer(tokenizer, [text for text, _ in real_vocab(name).cases])
    found = check_tokenizer(next((tmp_path / "out").glob("*.gguf")), tokenizer, texts)
    assert not found.chat_mismatches, found.chat_mismatches[:3]
    assert not found.text_mismatches, found.text_mismatches[:3]


def _unchanged_by_normalizer(tokenizer, texts: list[str]) -> tuple[str, ...]:
    """The texts the tokenizer's Unicode normalizer leaves as they are: llama.cpp has no such step
    (the export notes it), so only these tokenize alike in both."""
    normalizer = tokenizer.backend_tokenizer.normalizer
    return tuple(t for t in texts if normalizer is None or normalizer.normalize_str(t) == t)


# the tokenizer side alone, for a vocabulary whose family has no GGUF export yet: a family with an
# export and the same kind of vocabulary carries it
VOCAB_ONLY = {"qwen35": "qwen3"}


@pytest.mark.parametrize("name", VOCAB_ONLY)
def test_llama_cpp_tokenizes_the_real_vocabulary_like_hugging_face(name: str, real_vocab, tmp_path: Path) -> None:
    """The vocabulary Kestrel writes for this tokenizer: llama.cpp's test strings, plain and
    chat-rendered, tokenize in llama.cpp as in Hugging Face (after the export's own settling)."""
    vocab = real_vocab(name)
    src = resolve_source(save_tiny_model(VOCAB_ONLY[name], vocab.tokenizer, tmp_path / name, **SMALL))
    built = build_vocab(vocab.tokenizer, int(src.config.vocab_size), vocab.tokenizer.chat_template)
    stage = tmp_path / "stage"
    stage.mkdir()
    assert settle_tokenizer(stage, src, built, vocab.tokenizer).matches
    write_gguf(stage / "v.gguf", None, src.lm_config, src.family, built, "f16", name)
    texts = [text for text, _ in vocab.cases]
    kept = _unchanged_by_normalizer(vocab.tokenizer, texts)
    if len(kept) < len(texts):  # Qwen's NFC: said in the export's notes
        assert any("normalizes text to NFC" in note for note in built.notes), built.notes
    found = check_tokenizer(stage / "v.gguf", vocab.tokenizer, kept)
    assert not found.chat_mismatches, found.chat_mismatches[:3]
    assert not found.text_mismatches, found.text_mismatches[:3]


def test_token_text_on_two_ids_is_refused_before_llama_cpp_aborts(real_vocab) -> None:
    """transformers' conversion of Gemma 4's vocabulary turns byte token <0x09> (id 247) into a
    second "\t" (id 255968 is "\t"): llama.cpp would abort loading it (GGML_ASSERT in llama-vocab)."""
    tokenizer = real_vocab("gemma-4").tokenizer
    with pytest.raises(KestrelError, match=r"1 token text\(s\) to more than one id, e.g. '\\t' \(ids 247 and 255968\)"):
        build_vocab(tokenizer, len(tokenizer), tokenizer.chat_template)
