"""The GGUF export: vocabulary, weights, quantization, checks, Modelfile.

Order of work, cheapest check first:
1. the vocabulary alone is written to a probe file and llama.cpp tokenizes test texts with it;
   for byte-level BPE the pre-tokenizer name is settled here (the guess from the split regex,
   then the other names llama.cpp has, until its tokens equal Hugging Face's);
2. the reference runs (Hugging Face, fp32, adapter unmerged) are made;
3. the 16-bit (or q8_0) file is written tensor by tensor and checked: a 16-bit file must give
   the reference's greedy tokens;
4. other types are quantized from that file by llama.cpp and checked (top-1 agreement
   reported), and the 16-bit intermediate is deleted;
5. the embedded chat template is rendered and compared, and the Modelfile written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from kestrel.errors import KestrelError
from kestrel.export import check as checks
from kestrel.export.formats import _quant_notes, compute_device, gguf_basename, load_tokenizer, n_params
from kestrel.export.gguf_tokenizer import GGUFVocab, build_vocab
from kestrel.export.gguf_writer import gguf_nbytes, write_gguf
from kestrel.export.merge import ModelTensors
from kestrel.export.mmproj import PROJECTORS as MMPROJ_TYPES, has_mmproj, missing_part, write_mmproj
from kestrel.export.modelfile import detect_chat_format, end_of_turn_tokens, modelfile
from kestrel.export.quantize import DIRECT, estimate_bytes, quantize, rows_fit_blocks
from kestrel.export.source import ExportSource

Progress = Callable[[float, str], None]
_MB = 2**20
_TIE_TOL = {"f32": checks.TIE_TOL, "f16": checks.TIE_TOL, "bf16": 4 * checks.TIE_TOL}  # bf16 rounds 8x coarser
_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "12 + 7 = 19."},
    {"role": "user", "content": "And 3 + 4?"},
]


def _variants(vocab: GGUFVocab) -> list[dict[str, Any]]:
    if vocab.model == "gpt2":
        return [{"pre": name} for name in (vocab.pre, *vocab.candidate_pres)]
    # llama.cpp's SentencePiece tokenizer puts the dummy prefix before every text fragment,
    # including after each special token; Hugging Face's only before the first one. Which setting
    # reproduces the chat prompts depends on the template, so both are tried.
    return [{"add_space_prefix": vocab.add_space_prefix}, {"add_space_prefix": not vocab.add_space_prefix}]


def settle_tokenizer(stage: Path, src: ExportSource, vocab: GGUFVocab, tokenizer: Any) -> checks.TokenizerCheck:
    """Tokenizer check on a vocabulary-only file, trying llama.cpp's settings (the pre-tokenizer
    name for byte-level BPE, the space prefix for SentencePiece) until its tokens equal Hugging
    Face's; leaves `vocab` at the best setting, chat prompts first."""
    probe = stage / ".vocab-probe.gguf"
    best: tuple[checks.TokenizerCheck, dict[str, Any]] | None = None
    for variant in _variants(vocab):
        for key, value in variant.items():
            setattr(vocab, key, value)
        write_gguf(probe, None, src.lm_config, src.family, vocab, "f16", src.name)
        try:
            found = checks.check_tokenizer(probe, tokenizer)
        finally:
            probe.unlink()
        if best is None or found.cost() < best[0].cost():
            best = (found, variant)
        if found.matches:
            break
    assert best is not None
    for key, value in best[1].items():
        setattr(vocab, key, value)
    return best[0]


def _tokenizer_passed(found: checks.TokenizerCheck, vocab: GGUFVocab, result: Any) -> bool:
    """Byte-level BPE must match everywhere. SentencePiece must match on chat prompts; where
    llama.cpp's space-prefix rule makes plain text differ, that is noted, not failed."""
    if found.matches:
        return True
    if vocab.model in ("llama", "t5") and not found.chat_mismatches:
        result.notes.append("llama.cpp adds SentencePiece's leading space differently from Hugging Face for text "
                            f"outside the chat template, e.g. {found.text_mismatches[0]}")
        return True
    return False


def _needed_bytes(tensors: ModelTensors, src: ExportSource, base_type: str, quant: str, vocab: GGUFVocab) -> int:
    config = src.lm_config
    need = gguf_nbytes(tensors, config, src.family, base_type) + sum(len(t) + 16 for t in vocab.tokens) + 64 * _MB
    if quant not in DIRECT:
        need += estimate_bytes(n_params(tensors), quant, rows_fit_blocks(config))
    return need


def write_checked_gguf(src: ExportSource, stage: Path, result: Any, report: Progress, check: bool,
                       device: str | None) -> None:
    """Write `<name>-<quant>.gguf` and a Modelfile into `stage`, checking each step into `result`."""
    from kestrel.export import check_disk_space

    quant = result.quant
    if not src.family.gguf:
        raise KestrelError(
            f"GGUF export of {src.family.model_type} models (llama.cpp's {src.family.gguf_arch!r}) is not written by "
            "Kestrel yet: their layers' tensors have no llama.cpp mapping here. Export `merged` (16-bit "
            "safetensors, which llama.cpp's convert_hf_to_gguf.py converts) or `adapter` instead"
        )
    tensors = ModelTensors(src.model_dir, src.adapter_dir, compute_device(device), image_text=src.image_text)
    _quant_notes(src, tensors, result)
    tokenizer = load_tokenizer(src, result)
    chat_format = detect_chat_format(tokenizer.chat_template)
    stops = end_of_turn_tokens(chat_format, tokenizer)
    vocab = build_vocab(tokenizer, int(src.lm_config.vocab_size), tokenizer.chat_template, tuple(stops))
    result.notes += vocab.notes
    base_type = quant if quant in DIRECT else "f16"
    check_disk_space(stage, _needed_bytes(tensors, src, base_type, quant, vocab), f"the {quant} GGUF file")

    report(0.02, "checking the tokenizer with llama.cpp")
    tok_check = settle_tokenizer(stage, src, vocab, tokenizer)
    passed = _tokenizer_passed(tok_check, vocab, result)
    result.checks["tokenizer"] = {"passed": passed, "model": vocab.model, "pre": vocab.pre,
                                  "add_space_prefix": vocab.add_space_prefix,
                                  "mismatches": tok_check.chat_mismatches + tok_check.text_mismatches}
    if not passed:
        return  # llama.cpp would read different tokens than the model was trained on
    refs = []
    if check:
        report(0.05, "running the Hugging Face reference")
        refs = checks.reference_runs(src.model_dir, src.adapter_dir, tokenizer, device, tensors)

    name = gguf_basename(src.name)
    path = stage / (f"{name}-{quant}.gguf" if quant in DIRECT else f".{name}-{base_type}.tmp.gguf")
    report(0.1, f"writing {base_type} GGUF")
    if src.image_text and not has_mmproj(src.config):
        result.notes.append("an image-text model: the GGUF holds its language model; its vision tower is not "
                            f"exported (Kestrel writes llama.cpp's projector file for {', '.join(MMPROJ_TYPES)} only)")
    result.notes += write_gguf(path, tensors, src.lm_config, src.family, vocab, base_type, src.name,
                               on_tensor=lambda i, n: report(0.1 + 0.5 * i / n, f"wrote tensor {i}/{n}"))
    if check:
        report(0.62, f"checking the {base_type} file with llama.cpp")
        exact = base_type in _TIE_TOL
        result.checks[f"gguf_{base_type}"] = checks.check_gguf(path, refs, exact, _TIE_TOL.get(base_type, 0.0))
    if quant not in DIRECT:
        final = stage / f"{name}-{quant}.gguf"
        report(0.7, f"quantizing to {quant} with llama.cpp")
        quantize(path, final, quant)
        path.unlink()
        path = final
        if check:
            report(0.9, f"checking the {quant} file with llama.cpp")
            result.checks[f"gguf_{quant}"] = checks.check_gguf(path, refs, exact=False)

    missing = missing_part(src.model_dir, src.config) if src.image_text and has_mmproj(src.config) else None
    if missing:
        result.notes.append(f"no projector file: {missing}")
    elif src.image_text and has_mmproj(src.config):
        report(0.95, "writing the vision projector file")
        result.checks["mmproj"] = _write_checked_mmproj(stage / f"{name}-mmproj-f16.gguf", path, src, result)
    result.checks["chat_template"] = checks.check_template(path, tokenizer, _MESSAGES)
    (stage / "Modelfile").write_text(modelfile(path.name, chat_format, stops))
    result.checks["modelfile"] = {"chat_format": chat_format, "stops": stops}
    result.passed = _all_passed(result.checks)


def _write_checked_mmproj(path: Path, model_path: Path, src: ExportSource, result: Any) -> dict[str, Any]:
    """`<name>-mmproj-f16.gguf` from the checkpoint's vision tower (which training leaves frozen), checked
    by encoding an image with llama.cpp's mtmd beside the language model's file."""
    result.notes += write_mmproj(path, src.model_dir, src.config)
    return checks.check_mmproj(path, model_path, src.model_dir)


def _all_passed(found: dict[str, Any]) -> bool:
    ok = found["tokenizer"]["passed"] and found["chat_template"]["jinja_matches"]
    ok = ok and found.get("mmproj", {"passed": True})["passed"]
    return ok and all(c.passed for k, c in found.items() if isinstance(c, checks.GGUFCheck))
