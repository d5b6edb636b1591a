"""The tokenizer as llama.cpp reads it from a GGUF file.

A Hugging Face fast tokenizer (its `tokenizer.json`, as `backend_tokenizer.to_str()` gives it, so a
folder holding only `tokenizer.model` works too) becomes one of three llama.cpp vocabularies:

- byte-level BPE (`tokenizer.ggml.model = "gpt2"`: GPT-2, Llama 3, Qwen 2/3, the demo model): the
  byte-to-unicode token strings and the merges, plus the name of llama.cpp's pre-tokenizer
  (`tokenizer.ggml.pre`), which selects the regex that splits text before BPE. The name is read
  from the tokenizer's split regex; `candidate_pres` lists the others to try when the check that
  tokenizes a test text with both tokenizers disagrees (`kestrel.export.check.check_tokenizer`).
- SentencePiece-style BPE with byte fallback (`"llama"`: Mistral, Gemma): pieces with `▁` for
  spaces, `<0xNN>` byte tokens, and scores. llama.cpp merges the adjacent pair whose joined piece
  has the highest score, so a piece's score is minus the rank of the first merge that makes it:
  the merge order Hugging Face applies.
- SentencePiece Unigram (`"t5"`, llama.cpp's Unigram tokenizer, usable with any architecture):
  pieces and their log-probabilities as scores, and SentencePiece's normalization table.

Special tokens are CONTROL (llama.cpp never produces them from plain text and hides them when
printing), other added tokens USER_DEFINED, rows of the embedding past the tokenizer UNUSED.

A BPE that claims byte fallback but has no `<0xNN>` byte tokens (what `AutoTokenizer` makes of a
GGUF vocabulary such as llama.cpp's Llama 3 one) would make llama.cpp abort its process; with a
byte-level pre-tokenizer it is exported as the byte-level BPE it is (noted), otherwise refused
before anything is written (`_kind`); so is a vocabulary giving one text to two ids, which llama.cpp
also aborts on (`_refuse_duplicates`). A Unicode normalizer (Qwen's NFC) has no llama.cpp
counterpart: noted.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from kestrel.errors import KestrelError

# token types, as gguf.TokenType numbers them
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The split regexes of the byte-level tokenizers llama.cpp knows, by its pre-tokenizer name.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KNOWN_PRE = {_GPT2_RE: "gpt-2", _LLAMA3_RE: "llama-bpe", _QWEN2_RE: "qwen2"}
PRE_NAMES = ("gpt-2", "llama-bpe", "qwen2", "default")


@dataclass
class GGUFVocab:
    """Everything under `tokenizer.*` in a GGUF file."""

    model: str  # "gpt2" (byte-level BPE), "llama" (SentencePiece-style BPE) or "t5" (Unigram)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None  # llama.cpp pre-tokenizer, byte-level BPE only
    candidate_pres: tuple[str, ...] = ()  # other names to try, best guess first
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad, eot
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    precompiled_charsmap: bytes | None = None  # Unigram only
    notes: list[str] = field(default_factory=list)  # for the export's notes; not written to the file

    def add_to(self, writer: Any) -> None:
        """Write the vocabulary into a `gguf.GGUFWriter` (before its header is written)."""
        writer.add_tokenizer_model(self.model)
        if self.pre:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.merges:
            writer.add_token_merges(self.merges)
        adders = {
            "bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "unk": writer.add_unk_token_id,
            "pad": writer.add_pad_token_id, "eot": writer.add_eot_token_id,
        }
        for key, token_id in self.special_ids.items():
            adders[key](token_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.model == "t5":  # Hugging Face keeps runs of spaces unless its normalizer removes them
            writer.add_remove_extra_whitespaces(False)
        if self.precompiled_charsmap:
            writer.add_precompiled_charsmap(self.precompiled_charsmap)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)


def _split_regex(pre_tokenizer: dict | None) -> str | None:
    """The regex that splits text before BPE: a Split step's, or GPT-2's inside a ByteLevel step."""
    if pre_tokenizer is None:
        return None
    steps = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer["type"] == "Sequence" else [pre_tokenizer]
    for step in steps:
        if step["type"] == "Split":
            pattern = step.get("pattern", {})
            return pattern.get("Regex") or pattern.get("String")
        if step["type"] == "ByteLevel" and step.get("use_regex", True):
            return _GPT2_RE
    return None


# Texts on which the known split regexes disagree: digit runs, case in contractions, punctuation
# before letters, runs of newlines and spaces.
_SPLIT_PROBES = ("12345 67", "IT'S we'LL", "(hello) [x]", "a\n\n  b\r\n", "x   y\t\tz", "\u00e9t\u00e9 \u65e5\u672c")


def _splits(regex: str, text: str) -> list[str]:
    from tokenizers import Regex, pre_tokenizers

    return [piece for piece, _ in pre_tokenizers.Split(Regex(regex), behavior="isolated").pre_tokenize_str(text)]


def _guess_pre(tok_json: dict) -> tuple[str, tuple[str, ...]]:
    """llama.cpp's pre-tokenizer name for the split regex, and the others to try, best first.

    A regex llama.cpp does not know by its text is compared, by how it splits probe texts, with
    the ones it does know; the closest goes first. The tokenizer check decides."""
    regex = _split_regex(tok_json.get("pre_tokenizer"))
    name = KNOWN_PRE.get(regex or "")
    if name is not None:
        return name, tuple(n for n in PRE_NAMES if n != name)
    if regex is None:
        return PRE_NAMES[0], PRE_NAMES[1:]
    ours = [_splits(regex, t) for t in _SPLIT_PROBES]
    differing = {known: sum(_splits(r, t) != o for t, o in zip(_SPLIT_PROBES, ours)) for r, known in KNOWN_PRE.items()}
    ranked = sorted(PRE_NAMES, key=lambda n: differing.get(n, len(_SPLIT_PROBES) + 1))
    return ranked[0], tuple(ranked[1:])


def _is_spm(tok_json: dict) -> bool:
    model = tok_json["model"]
    return model["type"] == "BPE" and bool(model.get("byte_fallback"))


def _adds_prefix_space(tok_json: dict) -> bool:
    """True when the tokenizer turns a leading "Hi" into "▁Hi" (Llama 2 / Mistral; not Gemma)."""
    pre = tok_json.get("pre_tokenizer") or {}
    for step in pre.get("pretokenizers", [pre]):
        if step.get("type") == "Metaspace":
            return step.get("prepend_scheme", "always") != "never" and step.get("add_prefix_space", True)
    norm = tok_json.get("normalizer") or {}
    for step in norm.get("normalizers", [norm]):
        if step.get("type") == "Prepend":
            return True
    return False


def _merge_strings(merges: list) -> list[str]:
    """tokenizers writes merges as "a b" (old) or ["a", "b"] (new); llama.cpp wants "a b"."""
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def _spm_scores(vocab: dict[str, int], merges: list[str], n: int) -> list[float]:
    scores = [0.0] * n
    done: set[int] = set()
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1)
        token_id = vocab.get(left + right)
        if token_id is not None and token_id not in done:
            scores[token_id] = -float(rank)
            done.add(token_id)
    return scores


def _special_ids(tokenizer: Any, eot_texts: tuple[str, ...]) -> dict[str, int]:
    ids: dict[str, int] = {}
    for key, token_id in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                          ("unk", tokenizer.unk_token_id), ("pad", tokenizer.pad_token_id)):
        if token_id is not None:
            ids[key] = int(token_id)
    vocab = tokenizer.get_vocab()
    for text in eot_texts:
        if text in vocab:
            ids["eot"] = vocab[text]
            break
    return ids


def _adds_bos_eos(tokenizer: Any) -> tuple[bool, bool]:
    """Whether encoding plain text adds BOS / EOS, read from what the tokenizer actually does."""
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    add_bos = bos is not None and len(ids) > len(plain) and ids[0] == bos
    add_eos = eos is not None and len(ids) > len(plain) and ids[-1] == eos
    return add_bos, add_eos


def _token_table(tok_json: dict, vocab_size: int, kind: str) -> tuple[list[str], list[int]]:
    """Token strings and types for every embedding row, by id; rows past the tokenizer UNUSED."""
    model = tok_json["model"]
    if kind == "t5":
        id_to_text = {i: piece for i, (piece, _) in enumerate(model["vocab"])}
        unk = model.get("unk_id")
    else:
        id_to_text = {i: t for t, i in model["vocab"].items()}
        unk = model["vocab"].get(model.get("unk_token") or "")
    added = {a["id"]: a for a in tok_json.get("added_tokens", [])}
    id_to_text.update({token_id: entry["content"] for token_id, entry in added.items()})
    n_tok = max(id_to_text) + 1
    if n_tok > vocab_size:
        raise KestrelError(
            f"the tokenizer has {n_tok} tokens but the model's embedding only {vocab_size} rows; "
            "the tokenizer does not belong to this model"
        )
    _refuse_duplicates(id_to_text)
    tokens, types = [], []
    for token_id in range(vocab_size):
        text = id_to_text.get(token_id)
        tokens.append(f"[PAD{token_id}]" if text is None else text)
        if text is None:
            types.append(UNUSED)
        elif token_id in added and token_id != unk:
            types.append(CONTROL if added[token_id].get("special") else USER_DEFINED)
        elif kind != "gpt2" and text.startswith("<0x") and len(text) == 6 and text.endswith(">"):
            types.append(BYTE)
        else:
            types.append(UNKNOWN if kind != "gpt2" and token_id == unk else NORMAL)
    return tokens, types


def _refuse_duplicates(id_to_text: dict[int, str]) -> None:
    """llama.cpp maps each token text to one id and aborts loading a vocabulary where two ids share
    a text (`id_to_token.size() == token_to_id.size()`): said here, before anything is written."""
    first: dict[str, int] = {}
    shared = []
    for token_id in sorted(id_to_text):
        text = id_to_text[token_id]
        if text in first:
            shared.append(f"{text!r} (ids {first[text]} and {token_id})")
        else:
            first[text] = token_id
    if shared:
        raise KestrelError(
            f"the tokenizer gives {len(shared)} token text(s) to more than one id, e.g. {', '.join(shared[:3])}; "
            "llama.cpp aborts loading such a vocabulary. Re-save the tokenizer from its original model (a conversion "
            "from GGUF can turn a byte token such as <0x09> into its character) or remove the duplicate added token")


def _unicode_form(tok_json: dict) -> str | None:
    """The Unicode normal form (NFC, NFKC, ...) the tokenizer's normalizer applies, if any."""
    norm = tok_json.get("normalizer") or {}
    for step in norm.get("normalizers", [norm]):
        if step.get("type") in ("NFC", "NFD", "NFKC", "NFKD"):
            return step["type"]
    return None


def _byte_tokens_missing(vocab: dict[str, int]) -> int:
    """How many of the 256 byte tokens `<0x00>` .. `<0xFF>` of byte fallback `vocab` lacks."""
    return sum(f"<0x{b:02X}>" not in vocab for b in range(256))


def _splits_into_bytes(tok_json: dict) -> bool:
    """Whether the pre-tokenizer maps text to byte-level symbols (GPT-2's ByteLevel)."""
    pre = tok_json.get("pre_tokenizer") or {}
    return any(step.get("type") == "ByteLevel" for step in pre.get("pretokenizers", [pre]))


def _kind(tok_json: dict, notes: list[str] | None = None) -> str:
    """llama.cpp's name for the tokenizer's kind. A BPE that claims byte fallback without the 256
    byte tokens is inconsistent, and llama.cpp aborts the process loading it (`byte_to_token`
    throws): when its pre-tokenizer is byte-level its bytes never fall back, so it is byte-level
    BPE (noted in `notes`); otherwise it cannot be exported, which is said before anything is written."""
    model = tok_json["model"]
    if model["type"] == "Unigram":
        return "t5"  # llama.cpp's name for its SentencePiece-Unigram tokenizer
    if model["type"] == "BPE":
        if not _is_spm(tok_json):
            return "gpt2"
        missing = _byte_tokens_missing(model["vocab"])
        if not missing:
            return "llama"
        if _splits_into_bytes(tok_json):
            if notes is not None:
                notes.append("the tokenizer claims byte fallback but is byte-level BPE (a ByteLevel pre-tokenizer, no "
                             "<0xNN> byte tokens), as a conversion from GGUF writes it; exported as byte-level BPE")
            return "gpt2"
        raise KestrelError(
            f"the tokenizer is inconsistent: it claims byte fallback but lacks {missing} of the 256 byte tokens "
            "<0x00>..<0xFF> that needs, and llama.cpp would abort loading it. Re-save the tokenizer from its original "
            "model (tokenizer.json with byte_fallback matching its vocabulary) and export again")
    raise KestrelError(
        f"GGUF export supports BPE (byte-level or SentencePiece-style) and Unigram tokenizers; this one is {model['type']}"
    )


def _charsmap(tok_json: dict) -> bytes | None:
    """SentencePiece's normalization table, which llama.cpp's Unigram tokenizer applies."""
    norm = tok_json.get("normalizer") or {}
    for step in norm.get("normalizers", [norm]):
        if step.get("type") == "Precompiled" and step.get("precompiled_charsmap"):
            return base64.b64decode(step["precompiled_charsmap"])
    return None


def build_vocab(tokenizer: Any, vocab_size: int, chat_template: str | None,
                eot_texts: tuple[str, ...] = ()) -> GGUFVocab:
    """The GGUF vocabulary of a Hugging Face fast tokenizer, padded to the model's `vocab_size` rows.

    `eot_texts` are end-of-turn tokens to try, in order, for `tokenizer.ggml.eot_token_id`.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise KestrelError("GGUF export needs a fast tokenizer (tokenizer.json); this one is a slow tokenizer")
    tok_json = json.loads(tokenizer.backend_tokenizer.to_str())
    notes: list[str] = []
    kind = _kind(tok_json, notes)
    form = _unicode_form(tok_json)
    if form is not None:  # as llama.cpp's own converter: its tokenizers have no Unicode normalization step
        notes.append(f"the tokenizer normalizes text to {form} before tokenizing; llama.cpp does not, so text not "
                     f"already in {form} (e.g. an accent written as a combining character) tokenizes differently there")
    tokens, types = _token_table(tok_json, vocab_size, kind)
    add_bos, add_eos = _adds_bos_eos(tokenizer)
    vocab = GGUFVocab(model=kind, tokens=tokens, types=types, special_ids=_special_ids(tokenizer, eot_texts),
                      add_bos=add_bos, add_eos=add_eos, chat_template=chat_template, add_space_prefix=False,
                      notes=notes)
    model = tok_json["model"]
    if kind == "gpt2":
        vocab.merges = _merge_strings(model.get("merges", []))
        vocab.pre, vocab.candidate_pres = _guess_pre(tok_json)
    elif kind == "llama":
        vocab.scores = _spm_scores(model["vocab"], _merge_strings(model.get("merges", [])), vocab_size)
        vocab.add_space_prefix = _adds_prefix_space(tok_json)
    else:
        scores = [float(score) for _, score in model["vocab"]]
        vocab.scores = scores + [0.0] * (vocab_size - len(scores))
        vocab.add_space_prefix = _adds_prefix_space(tok_json)
        vocab.precompiled_charsmap = _charsmap(tok_json)
    return vocab
