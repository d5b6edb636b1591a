"""Real tokenizers for the tests: llama.cpp's vocabulary files of real models, as Hugging Face
tokenizers, with llama.cpp's tokenizer test strings and their expected ids.

    python3 -m tests.support.real_vocab      # install.sh runs it: fetch once, build the tokenizers
    vocab = real_tokenizer("qwen2")           # RealVocab(name, tokenizer, cases); cached on disk

The source distribution of llama-cpp-python (the version pinned in requirements.txt) carries
`vendor/llama.cpp/models/ggml-vocab-<name>.gguf` (the vocabulary and chat template of a real model,
no weights) with `.gguf.inp` (test strings, separated by `__ggml_vocab_test__` lines) and
`.gguf.out` (one line of expected ids per string, encoded without special tokens). Only the files
of the families Kestrel supports are kept, under VOCAB_DIR. `transformers` turns a GGUF vocabulary
into a fast tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`); that conversion takes
a minute or two per vocabulary, so each is saved once under VOCAB_DIR/hf/<name>.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VOCAB_DIR = Path.home() / ".cache" / "kestrel" / "vocab"  # the one place that names it (install.sh runs this module)

# llama.cpp's vocabulary name -> the real models it stands for
VOCABS = {
    "llama-bpe": "Llama 3 (byte-level BPE, llama-bpe split)",
    "qwen2": "Qwen 2 / Qwen 3 (byte-level BPE, qwen2 split)",
    "qwen35": "Qwen 3.5 (byte-level BPE, qwen35 split)",
    "gemma-4": "Gemma 4 (SentencePiece-style BPE, llama.cpp's gemma4 tokenizer)",
    "phi-3": "Phi-3 (SentencePiece BPE, Llama 2 vocabulary)",
    "llama-spm": "Llama 2 / Mistral (SentencePiece BPE with byte fallback)",
}
# Where transformers' conversion of a vocabulary does not give llama.cpp's test ids, and why.
INEXACT = {
    "llama-bpe": "transformers converts llama-bpe with GPT-2's split regex (ByteLevel use_regex) instead of Llama 3's, "
                 "without ignore_merges: digit runs ('3333'), contractions and Khmer tokenize differently (11 of 46)",
    "qwen35": "transformers gives Qwen 3.5 Qwen 2's NFC normalizer; Qwen 3.5's tokenizer does not normalize, so "
              "decomposed accents ('e' + U+0301) differ (3 of 50)",
    "phi-3": "transformers' conversion of Phi-3's SentencePiece vocabulary loses its space handling: a leading space, "
             "whitespace-only strings and most sentences differ (45 of 46)",
    "gemma-4": "transformers converts llama.cpp's gemma4 BPE vocabulary into a SentencePiece Unigram with byte fallback: "
               "runs of spaces, digits and some words differ (8 of 46), and byte token <0x09> becomes a second '\\t'; "
               "AutoTokenizer cannot read it at all (_TOKENIZER_CLASS)",
}
# AutoTokenizer first builds the model's config from the GGUF's metadata, and transformers' Gemma 4
# config rejects llama.cpp's per-layer `gemma4.attention.head_count_kv` array (StrictDataclass-
# FieldValidationError on num_key_value_heads); the tokenizer class reads only the vocabulary.
_TOKENIZER_CLASS = {"gemma-4": "GemmaTokenizer"}
_SEPARATOR = "\n__ggml_vocab_test__\n"
_SUFFIXES = ("", ".inp", ".out")  # after ggml-vocab-<name>.gguf


class VocabMissing(RuntimeError):
    """The vocabulary files are not on this machine (./install.sh fetches them)."""


@dataclass
class RealVocab:
    name: str
    tokenizer: Any  # a transformers fast tokenizer
    cases: list[tuple[str, list[int]]]  # llama.cpp's test strings and the ids it expects (no special tokens)


def gguf_path(name: str, root: Path = VOCAB_DIR) -> Path:
    return root / f"ggml-vocab-{name}.gguf"


def missing_files(root: Path = VOCAB_DIR) -> list[Path]:
    files = [Path(f"{gguf_path(name, root)}{suffix}") for name in VOCABS for suffix in _SUFFIXES]
    return [path for path in files if not path.exists()]


def llama_cpp_pin(requirements: Path = REPO / "requirements.txt") -> str:
    """The version of llama-cpp-python requirements.txt pins."""
    found = re.search(r"^llama-cpp-python==(\S+)", requirements.read_text(), re.MULTILINE)
    if found is None:
        raise ValueError(f"{requirements} pins no llama-cpp-python version (a line `llama-cpp-python==X.Y.Z`)")
    return found.group(1)


def fetch(root: Path = VOCAB_DIR) -> list[Path]:
    """Extract the vocabulary files of VOCABS from llama-cpp-python's source distribution into
    `root`; nothing is downloaded when they are all there. Returns the files written."""
    if not missing_files(root):
        return []
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kestrel-vocab-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={llama_cpp_pin()}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        wanted = {f"{gguf_path(n, root).name}{s}" for n in VOCABS for s in _SUFFIXES}
        written = []
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                base = member.name.rsplit("/", 1)[-1]
                if member.isfile() and base in wanted and "/vendor/llama.cpp/models/" in member.name:
                    source = tar.extractfile(member)
                    assert source is not None
                    (root / base).write_bytes(source.read())
                    written.append(root / base)
    return written


def read_cases(name: str, root: Path = VOCAB_DIR) -> list[tuple[str, list[int]]]:
    """llama.cpp's test strings of `name` and their expected ids, as its test-tokenizer-0 reads them."""
    path = gguf_path(name, root)
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split(_SEPARATOR)
    ids = [[int(t) for t in line.split()] for line in Path(f"{path}.out").read_text().splitlines()]
    if texts[-1] == "":  # the file ends with a separator
        texts.pop()
    if len(texts) != len(ids):
        raise ValueError(f"{path}.inp has {len(texts)} test strings but {path}.out {len(ids)} lines of ids")
    return list(zip(texts, ids))


def _build(name: str, root: Path) -> None:
    """Convert the GGUF vocabulary with transformers and save it under root/hf/<name>."""
    import transformers

    cls = getattr(transformers, _TOKENIZER_CLASS.get(name, "AutoTokenizer"))
    tokenizer = cls.from_pretrained(root, gguf_file=gguf_path(name, root).name)
    tokenizer.save_pretrained(root / "hf" / name)


def real_tokenizer(name: str, root: Path = VOCAB_DIR) -> RealVocab:
    """The Hugging Face tokenizer of llama.cpp's `name` vocabulary (converted once, then loaded from
    its saved copy) and its test cases. Raises VocabMissing when the files are not fetched; a
    vocabulary transformers cannot convert raises what transformers raised."""
    from transformers import PreTrainedTokenizerFast

    if not gguf_path(name, root).exists():
        raise VocabMissing(f"{gguf_path(name, root)} is missing: run ./install.sh (it fetches llama.cpp's vocabularies)")
    saved = root / "hf" / name
    if not (saved / "tokenizer.json").exists():
        _build(name, root)
    # The saved tokenizer.json as written: a model class may rebuild its tokenizer from the vocabulary
    # instead (GemmaTokenizer turns Gemma 4's converted Unigram into a BPE: 32 of 46 test strings wrong, not 8).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(saved)
    return RealVocab(name, tokenizer, read_cases(name, root))


def main() -> None:
    """Fetch the vocabularies and convert each once (install.sh); a failed conversion is reported."""
    for path in fetch():
        print(f"fetched {path}")
    for name in VOCABS:
        if (VOCAB_DIR / "hf" / name / "tokenizer.json").exists():
            continue
        try:
            real_tokenizer(name)
            print(f"converted {name} to a Hugging Face tokenizer")
        except Exception as exc:  # noqa: BLE001 - a vocabulary transformers cannot read is reported, the others still built
            print(f"note: transformers cannot convert {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
