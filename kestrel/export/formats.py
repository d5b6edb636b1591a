"""The three export formats, each writing into a staging folder and checking what it wrote.

Called by `kestrel.export.export`, which owns the staging folder, the result and the cleanup.
Each writer fills `result.checks` and `result.notes` and sets `result.passed`.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kestrel.constants import slug
from kestrel.errors import KestrelError
from kestrel.export import check as checks
from kestrel.export.merge import ModelTensors, write_safetensors_shards
from kestrel.export.source import ExportSource

Progress = Callable[[float, str], None]
_MB = 2**20
_TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def load_tokenizer(src: ExportSource, result: Any) -> Any:
    """The tokenizer training used: ChatML is the template when the model ships none (as in
    `kestrel.model.loader.load_tokenizer`), said in the notes."""
    from transformers import AutoTokenizer

    from kestrel.model.loader import CHATML_TEMPLATE

    try:
        tokenizer = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise KestrelError(f"could not load the tokenizer from {src.tokenizer_dir}: {exc}") from exc
    if isinstance(tokenizer.chat_template, dict):  # several named templates: the default one is the chat
        tokenizer.chat_template = tokenizer.chat_template.get("default") or next(iter(tokenizer.chat_template.values()))
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
        result.notes.append("the tokenizer has no chat template; ChatML (Kestrel's training default) was used")
    return tokenizer


def _quant_notes(src: ExportSource, tensors: ModelTensors, result: Any) -> None:
    if tensors.dequantized:
        result.notes.append(
            f"the base checkpoint {src.model_dir} stores 4-bit (bitsandbytes) weights; the adapter was merged "
            "into their dequantization, not into original 16-bit weights"
        )
    elif src.method == "qlora" and src.adapter_dir is not None:
        result.notes.append(f"QLoRA adapter merged into the original 16-bit weights of {src.model_dir}")


def compute_device(device: str | None) -> torch.device:
    """Where merges and casts run: the GPU when there is one (tens of times faster for an 8B model)."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def n_params(tensors: ModelTensors) -> int:
    return sum(math.prod(tensors.shape(n)) for n in tensors.names())


def size_basis(source: str | Path) -> tuple[int, bool]:
    """(weights an export of `source` writes, whether its rows fill k-quant blocks), read from the
    config and the safetensors headers: no tensor is loaded. An adapter merges into its base, so
    the base's count."""
    from kestrel.export.quantize import rows_fit_blocks
    from kestrel.export.source import resolve_source

    src = resolve_source(source)
    return n_params(ModelTensors(src.model_dir)), rows_fit_blocks(src.config)


# --- adapter -------------------------------------------------------------------------------------

def check_adapter(stage: Path, src: ExportSource, tokenizer: Any, device: str | None) -> dict[str, Any]:
    """The copied adapter loads onto its base with PEFT and gives finite logits that differ from
    the base model's (shapes were already matched against the base by ModelTensors)."""
    model = checks.load_reference(src.model_dir, stage, device)
    ids = checks.prompt_ids(tokenizer)[0]
    tuned = checks.full_logits(model, ids)
    with model.disable_adapter():
        base = checks.full_logits(model, ids)
    del model
    finite = bool(np.isfinite(tuned).all())
    changed = float(abs(tuned - base).max())
    return {"passed": finite and changed > 0, "finite": finite, "max_change_from_base": changed}


def export_adapter(src: ExportSource, stage: Path, result: Any, report: Progress, check: bool, device: str | None) -> None:
    from kestrel.export import check_disk_space

    if src.adapter_dir is None:
        raise KestrelError(f"{src.model_dir} is a full model with no adapter; export it as merged or gguf")
    tensors = ModelTensors(src.model_dir, src.adapter_dir, image_text=src.image_text)  # raises when it does not fit
    files = [src.adapter_dir / "adapter_config.json", src.adapter_dir / "adapter_model.safetensors"]
    check_disk_space(stage, sum(f.stat().st_size for f in files) + 64 * _MB, "the adapter")
    for f in files:
        shutil.copy2(f, stage / f.name)
    tokenizer = load_tokenizer(src, result)
    tokenizer.save_pretrained(stage)
    result.checks["adapter"] = {"passed": True, "modules": len(tensors.lora.pairs) if tensors.lora else 0}
    if check:
        report(0.5, "loading the adapter onto its base model")
        result.checks["adapter"].update(check_adapter(stage, src, tokenizer, device))
    result.passed = result.checks["adapter"]["passed"]
    report(0.9, "adapter copied and checked")


# --- merged --------------------------------------------------------------------------------------

def _merged_dtype(tensors: ModelTensors, quant: str) -> torch.dtype:
    if quant != "auto":
        return _TORCH_DTYPES[quant]
    stored = {tensors.stored_dtype(n) for n in tensors.names()}
    return torch.float32 if stored == {torch.float32} else (torch.float16 if torch.float16 in stored else torch.bfloat16)


def check_merged(merged_dir: Path, refs: list[checks.ReferenceRun], device: str | None) -> dict[str, Any]:
    """Logits of the merged model vs the reference (base + adapter, unmerged) on the same tokens.

    The error is max |logit difference| over the reference logits' standard deviation. It must
    stay within twice what rounding PEFT's own merge to the merged dtype causes by itself
    (`ReferenceRun.rounded`), plus 1e-4 for sums done in another order. A wrong merge (scale,
    transposition, a module left out) moves logits by the adapter's whole effect, far beyond that."""
    model = checks.load_reference(merged_dir, None, device)
    worst = baseline = 0.0
    agree = total = 0
    for ref in refs:
        seq = ref.prompt_ids + ref.tokens[:-1]
        ours = checks.full_logits(model, seq)
        scale = float(ref.logits.std()) or 1.0
        worst = max(worst, float(abs(ours - ref.logits).max()) / scale)
        if ref.rounded is not None:
            baseline = max(baseline, float(abs(ref.rounded - ref.logits).max()) / scale)
        agree += int((ours.argmax(-1) == ref.logits.argmax(-1)).sum())
        total += len(seq)
    del model
    tol = 2 * baseline + 1e-4
    return {"passed": worst <= tol, "max_error": worst, "tolerance": tol, "top1_agreement": agree / total}


def _copy_config(src: ExportSource, stage: Path, dtype: torch.dtype, untied: bool) -> None:
    config = src.config
    config.dtype = dtype
    if untied:
        config.tie_word_embeddings = False
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(stage)
    if (src.model_dir / "generation_config.json").is_file():
        shutil.copy2(src.model_dir / "generation_config.json", stage / "generation_config.json")


def export_merged(src: ExportSource, stage: Path, result: Any, report: Progress, check: bool, device: str | None) -> None:
    from kestrel.export import check_disk_space

    tensors = ModelTensors(src.model_dir, src.adapter_dir, compute_device(device), image_text=src.image_text)
    dtype = _merged_dtype(tensors, result.quant)
    check_disk_space(stage, tensors.nbytes(dtype) + 64 * _MB, "the merged model")
    _quant_notes(src, tensors, result)
    tokenizer = load_tokenizer(src, result)
    refs = checks.reference_runs(src.model_dir, src.adapter_dir, tokenizer, device, tensors, dtype) if check else []
    report(0.1, "writing merged weights")
    names = tensors.names()
    done = [0]

    def on_tensor(name: str) -> None:
        done[0] += 1
        report(0.1 + 0.7 * done[0] / len(names), f"merged {name}")

    write_safetensors_shards(tensors, stage, dtype, on_tensor=on_tensor)
    untied = tensors.lora is not None and "lm_head.weight" in tensors.lora.touched()
    _copy_config(src, stage, dtype, untied and bool(getattr(src.config, "tie_word_embeddings", False)))
    tokenizer.save_pretrained(stage)
    if check:
        report(0.85, "checking merged model against base + adapter")
        result.checks["merged"] = check_merged(stage, refs, device)
        result.passed = result.checks["merged"]["passed"]
    else:
        result.passed = True


# --- gguf ----------------------------------------------------------------------------------------

def gguf_basename(name: str) -> str:
    return slug(name, "model")


def export_gguf(src: ExportSource, stage: Path, result: Any, report: Progress, check: bool, device: str | None) -> None:
    from kestrel.export.gguf_export import write_checked_gguf

    write_checked_gguf(src, stage, result, report, check, device)
