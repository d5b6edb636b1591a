"""What a model with NF4 experts (`kestrel.model.expert_quant`) must satisfy, whatever the model.

Comparing its logits with the 16-bit model's measures NF4's rounding times the model's gain, and
a tiny random model's gain is large: in the tiny MXFP4 gpt-oss (expert weights about 10x the
initializer's scale) 1% of Gaussian noise on the experts moves the logits 11%, NF4's 9% moves
them 32%. So the two properties are checked apart:
- the NF4 model computes with its rounded weights: its logits equal those of its dequantized twin
  (`ExpertQuantHandle.undo()`: 16-bit parameters holding the NF4 values) within bf16 noise;
- the rounded weights are the right ones, element by element: each within NF4's worst rounding of
  its 64-block (in the stored layout, as bitsandbytes quantizes it) of the expected weights.
A transposed read fails the first (relative error 1.4 on the tiny gpt-oss); packing a reordered
tensor (gate and up columns de-interleaved, a transposed copy) fails the second.
"""

from __future__ import annotations

import torch
from torch import nn

from kestrel.kernels.moe.nf4_experts import BLOCKSIZE
from kestrel.kernels.nf4 import NF4_CODE

# Rounding to the nearest level costs at most half the widest gap between levels (0.152, between
# -1 and -0.696), times the block's absmax; the absmax is itself stored in 8 bits (double
# quantization: <= 1.3% off on the tiny models' weights, whose block absmaxes lie within one order
# of magnitude; a block far below its tensor's mean absmax can be off more) and the value rounded
# to bf16 (2^-8): 0.03 covers both.
NF4_WORST = max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:])) / 2 + 0.03
# The NF4 model and its twin multiply the same bf16 values; this model's own bf16 rounding moves its
# logits 1.3% from fp32. A wrong layout moves them by about their size.
TWIN_TOLERANCE = 0.02


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """(ceil(n / 64), 64) fp32: the blocks bitsandbytes quantizes `t` in (row-major; the short last one zero-padded,
    which leaves its absmax)."""
    flat = t.detach().float().flatten()
    return torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCKSIZE)).view(-1, BLOCKSIZE)


def assert_nf4_rounding_of(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """`got` (dequantized NF4) within NF4_WORST x absmax of `want`'s 64-blocks, `want` in its stored layout."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    want_blocks = _blocks(want.to(got.device))
    error = (_blocks(got) - want_blocks).abs() / want_blocks.abs().amax(1, keepdim=True).clamp_min(1e-30)
    worst = error.max().item()
    assert worst <= NF4_WORST, f"{name}: a weight is {worst:.3f} x its block's absmax off (NF4 rounds by <= {NF4_WORST:.3f})"


def assert_nf4_experts_hold(model: nn.Module, expected: dict[str, torch.Tensor], input_ids: torch.Tensor) -> None:
    """`model` has NF4 experts (`quantize_experts`); `expected`: their 16-bit weights by parameter name.
    Undoes the quantization (the model ends with 16-bit experts holding the NF4 values)."""
    with torch.no_grad():
        got = model(input_ids=input_ids, use_cache=False).logits.float()
        model.kestrel_expert_quant.undo()
        twin = model(input_ids=input_ids, use_cache=False).logits.float()
    error = _relative(got, twin)
    assert error < TWIN_TOLERANCE, f"NF4 experts' logits {error:.3f} off their dequantized twin's (tolerance {TWIN_TOLERANCE})"
    params = dict(model.named_parameters())
    for name, want in expected.items():
        assert_nf4_rounding_of(params[name], want, name)
