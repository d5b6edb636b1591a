"""llama.cpp runs in a child process during an export (kestrel/export/llama_child.py): an abort there
is an error naming the stage, this process lives on; and the inconsistent tokenizer that made
llama.cpp abort (byte-level BPE that also claims byte fallback, as a conversion from a GGUF
vocabulary writes it) is found before anything is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kestrel.errors import KestrelError
from kestrel.export import export, gguf_writer
from kestrel.export.check import check_tokenizer
from kestrel.export.gguf_tokenizer import build_vocab
from kestrel.export.llama_child import LlamaCrashError, run_in_child
from kestrel.export.source import resolve_source
from tests.support.export_fixtures import save_tiny_model, train_tokenizer


def test_a_child_returns_results_raises_errors_and_reports_crashes() -> None:
    assert run_in_child("joining", os.path.join, "a", "b") == os.path.join("a", "b")
    with pytest.raises(FileNotFoundError):
        run_in_child("listing", os.listdir, "/no/such/folder")
    with pytest.raises(LlamaCrashError, match=r"llama.cpp crashed while testing the stage name \(killed by SIGABRT, "
                                              r"exit code 134\)"):
        run_in_child("testing the stage name", os.abort)
    assert run_in_child("joining again", os.path.join, "c", "d") == os.path.join("c", "d")  # and goes on


def _byte_level_claiming_fallback(vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """Llama 3 style byte-level BPE whose model also says byte_fallback (no <0xNN> tokens)."""
    tokenizer = train_tokenizer("llama3", vocab_size)
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    data["model"]["byte_fallback"] = True
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(data))
    return tokenizer


def test_a_real_llama_cpp_abort_is_contained(tmp_path: Path) -> None:
    """A SentencePiece-style vocabulary without byte tokens (what the inconsistent tokenizer gave
    before it was detected) makes llama.cpp itself abort; the check reports it, naming the stage."""
    src = resolve_source("demo")
    tokenizer = train_tokenizer("llama3", 600)
    vocab = build_vocab(tokenizer, int(src.config.vocab_size), tokenizer.chat_template)
    vocab.model, vocab.scores = "llama", [0.0] * len(vocab.tokens)  # as the byte_fallback flag made it
    gguf_writer.write_gguf(tmp_path / "v.gguf", None, src.config, src.family, vocab, "f16", "bad")
    with pytest.raises(LlamaCrashError, match=r"while loading the vocabulary of v.gguf .*SIGABRT"):
        check_tokenizer(tmp_path / "v.gguf", tokenizer)


def test_byte_level_bpe_claiming_byte_fallback_exports_as_byte_level(tmp_path: Path) -> None:
    tokenizer = _byte_level_claiming_fallback()
    folder = save_tiny_model("llama", tokenizer, tmp_path / "model")
    result = export(folder, "gguf", tmp_path / "out", quant="f16")
    assert result.passed and result.checks["tokenizer"]["model"] == "gpt2"
    assert result.checks["gguf_f16"].greedy_identical
    assert any("claims byte fallback but is byte-level BPE" in note for note in result.notes)


def test_byte_fallback_without_byte_tokens_is_refused_before_writing(tmp_path: Path) -> None:
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "▁a": 4}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    with pytest.raises(KestrelError, match="inconsistent: it claims byte fallback but lacks 256 of the 256 byte tokens"):
        build_vocab(tokenizer, 8, None)
