"""The kernel tests' one tolerance rule."""

from __future__ import annotations

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tight: bool | None = None) -> None:
    """fp32: ~1e-5 relative. bf16: 2e-2 relative plus 1e-2 of the tensor's scale (a few ulp).
    `tight=False` for fp32 results built from bf16-rounded values."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = max(expected.float().abs().max().item(), 1.0)
    tight = expected.dtype == torch.float32 if tight is None else tight
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-5 if tight else 2e-2,
                               atol=(1e-5 if tight else 1e-2) * scale)
