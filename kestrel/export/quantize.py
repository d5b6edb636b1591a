"""GGUF quantization types, and llama.cpp's own quantizer run through `llama-cpp-python`.

f32, f16, bf16 and q8_0 are written directly by `kestrel.export.gguf_writer`; every other type is
made by `llama_model_quantize` from a 16-bit GGUF file, so the k-quant mixes (q4_k_m keeps some
tensors at q6_k, for instance) are exactly llama.cpp's. Tensors whose rows do not fit a type's
block (k-quants need rows of 256) get llama.cpp's fallback type, as with its command-line tool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kestrel.errors import KestrelError

DIRECT = ("f32", "f16", "bf16", "q8_0")
# name -> llama_ftype constant in llama_cpp; all of these need no importance matrix
LLAMA_QUANTS = {
    "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
    "q3_k_s": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
    "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "q3_k_l": "LLAMA_FTYPE_MOSTLY_Q3_K_L",
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
    "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
    "q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
    "q5_k_s": "LLAMA_FTYPE_MOSTLY_Q5_K_S",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
    "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
}
QUANT_TYPES = DIRECT + tuple(LLAMA_QUANTS)

# Upper bounds of bits per weight, for the disk-space check (k-quant mixes keep some tensors wider,
# and tensors too narrow for a type's blocks fall back to wider types).
BITS_PER_WEIGHT = {
    "f32": 32.0, "f16": 16.0, "bf16": 16.0, "q8_0": 8.5, "q6_k": 8.5, "q5_k_m": 8.5, "q5_k_s": 8.5,
    "q5_0": 8.5, "q5_1": 8.5, "q4_k_m": 8.5, "q4_k_s": 8.5, "q4_0": 8.5, "q4_1": 8.5, "q3_k_l": 8.5,
    "q3_k_m": 8.5, "q3_k_s": 8.5, "q2_k": 8.5, "iq4_nl": 8.5, "iq4_xs": 8.5,
}


@dataclass(frozen=True)
class QuantType:
    """What a GGUF type costs and loses: for size estimates and the studio's hints."""

    bits: float  # typical bits per weight of a large model (the k-quant mix included)
    quality: str  # the loss, after llama.cpp's perplexity table for its quantize tool (7B models)


QUANTS = {
    "f32": QuantType(32.0, "lossless; twice the size of f16 for no gain"),
    "f16": QuantType(16.0, "practically lossless"),
    "bf16": QuantType(16.0, "practically lossless; the training dtype of most models"),
    "q8_0": QuantType(8.5, "practically lossless"),
    "q6_k": QuantType(6.6, "extremely small loss"),
    "q5_k_m": QuantType(5.7, "very small loss; recommended"),
    "q5_k_s": QuantType(5.5, "small loss; recommended"),
    "q5_1": QuantType(6.0, "small loss (older type: prefer q5_k_m)"),
    "q5_0": QuantType(5.5, "small loss (older type: prefer q5_k_m)"),
    "q4_k_m": QuantType(4.9, "balanced size and quality; recommended"),
    "q4_k_s": QuantType(4.6, "noticeable loss"),
    "q4_1": QuantType(5.0, "noticeable loss (older type: prefer q4_k_m)"),
    "q4_0": QuantType(4.5, "noticeable loss (older type: prefer q4_k_m)"),
    "iq4_nl": QuantType(4.5, "noticeable loss; non-linear 4-bit"),
    "iq4_xs": QuantType(4.3, "noticeable loss; non-linear 4-bit, smaller"),
    "q3_k_l": QuantType(4.3, "substantial loss"),
    "q3_k_m": QuantType(3.9, "high loss"),
    "q3_k_s": QuantType(3.5, "very high loss"),
    "q2_k": QuantType(3.4, "extreme loss: for the tightest memory only"),
}


K_BLOCK = 256  # weights a k-quant block spans along a row: narrower rows fall back to wider types


def rows_fit_blocks(config: Any) -> bool:
    """Whether the model's rows fill k-quant blocks (hidden and MLP widths multiples of K_BLOCK).
    If not, llama.cpp stores those tensors in wider fallback types and the typical bits per weight
    no longer hold: sizes reach BITS_PER_WEIGHT."""
    return config.hidden_size % K_BLOCK == 0 and config.intermediate_size % K_BLOCK == 0


def size_hint(n_params: int, quant: str, rows_fit: bool) -> tuple[int, bool]:
    """(bytes, is it an upper bound) of a GGUF file of `n_params` weights in `quant`: the typical
    size when the rows fit the blocks (or the type has none), else the upper bound."""
    if rows_fit or quant in ("f32", "f16", "bf16"):
        return int(n_params * QUANTS[quant].bits / 8), False
    return int(n_params * BITS_PER_WEIGHT[quant] / 8), True


def check_quant(quant: str | None) -> str:
    """The normalised quantization name (default f16); an unknown one raises, listing the valid."""
    name = (quant or "f16").lower()
    if name not in QUANT_TYPES:
        raise KestrelError(f"unknown quantization type {quant!r}; valid types: {', '.join(QUANT_TYPES)}")
    return name


def estimate_bytes(n_params: int, quant: str, large_model: bool) -> int:
    """Bytes a GGUF file of `n_params` weights needs: typical size for large models, an upper
    bound for small ones (whose narrow rows fall back to wider types)."""
    bits = QUANTS[quant].bits * 1.1 if large_model else BITS_PER_WEIGHT[quant]
    return int(n_params * bits / 8)


def quantize(src: Path, dst: Path, quant: str, threads: int | None = None) -> None:
    """Quantize the 16-bit GGUF `src` to `dst` with llama.cpp (`llama_model_quantize`), in a child
    process (`kestrel.export.llama_child`): a crash there is an error naming this stage."""
    from kestrel.export import llama_child

    if quant not in LLAMA_QUANTS:
        raise KestrelError(f"{quant} is not made by llama.cpp's quantizer; choose one of {', '.join(LLAMA_QUANTS)}")
    rc = llama_child.run_in_child(f"quantizing {src.name} to {quant}", llama_child.quantize_file, src, dst,
                                  LLAMA_QUANTS[quant], threads or os.cpu_count() or 1)
    if rc != 0:
        raise KestrelError(f"llama.cpp could not quantize {src.name} to {quant} (error {rc})")
