"""gemv (kernels/gemv.py) against F.linear in float64: odd shapes (a K loop with a partial last
block, row counts that are no multiple of the block), biases, weights that are row slices of a
larger buffer (a fused q/k/v group), poisoned outputs, and the F.linear fallback for inputs the
kernel does not take."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kestrel.kernels.decode.gemv import gemv, gemv_applies, linear

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# (N, K): tiny, a K that is no power of two, N not a multiple of any block, K past one 2048 block
SHAPES = [(8, 16), (50, 72), (97, 1000), (33, 2500)]


@pytest.fixture(autouse=True)
def _triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", "triton")


def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    """New float buffers start as NaN, so an output element the kernel forgets to write shows."""
    original = torch.empty

    def poisoned(*args, **kwargs):
        out = original(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == x.dtype and y.shape == ref.shape and not y.isnan().any()
    scale = float(ref.abs().max())
    tight = x.dtype == torch.float32  # bf16: the output's own rounding (2^-8) dominates
    torch.testing.assert_close(y.double(), ref, rtol=1e-5 if tight else 1e-2, atol=(1e-5 if tight else 1e-2) * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(shape: tuple[int, int], dtype: torch.dtype, bias: bool,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    x = torch.randn(1, 1, k, generator=gen).to(DEVICE, dtype)
    _poison(monkeypatch)
    assert gemv_applies(x, w, b)
    _check(gemv(x, w, b), x, w, b)


def test_row_slice_of_a_fused_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member's rows [lo, hi) of a fused (q; k; v; A) buffer: row stride = K, offset storage."""
    gen = torch.Generator().manual_seed(3)
    buffer = torch.randn(70, 96, generator=gen).to(DEVICE)
    bias = torch.randn(70, generator=gen).to(DEVICE)
    x = torch.randn(1, 96, generator=gen).to(DEVICE)
    _poison(monkeypatch)
    for lo, hi in ((0, 40), (40, 56), (13, 70)):
        _check(linear(x, buffer[lo:hi], bias[lo:hi]), x, buffer[lo:hi], bias[lo:hi])


def test_fallback_to_linear() -> None:
    """Several rows, a non-unit column stride or mixed dtypes: plain F.linear, same result."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(24, 32, generator=gen).to(DEVICE)
    rows = torch.randn(3, 1, 32, generator=gen).to(DEVICE)
    assert not gemv_applies(rows, w, None)
    torch.testing.assert_close(linear(rows, w), F.linear(rows, w))
    assert not gemv_applies(rows[:1], w.t().contiguous().t(), None)
    assert not gemv_applies(rows[:1], w.double(), None)


def test_torch_backend_never_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", "torch")
    w, x = torch.randn(8, 16).to(DEVICE), torch.randn(1, 16).to(DEVICE)
    assert not gemv_applies(x, w, None)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))


def test_programmatic_dependent_launch_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """PDL only on a Hopper-or-later CUDA device, never interpreted, never with KESTREL_PDL=0; the
    launch keywords carry Triton's `launch_pdl` only when on."""
    from kestrel.kernels import _utils
    from kestrel.kernels.decode.gemv import k_launch

    assert not _utils.pdl(torch.device("cpu"))
    assert k_launch(4096, device=torch.device("cpu")) == {"BLOCK_K": 2048, "num_stages": 1, "PDL": False}
    assert _utils.pdl_launch(True) == {"PDL": True, "launch_pdl": True}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_utils, "_cuda_capability", lambda index: 9)
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("KESTREL_PDL", raising=False)
    assert _utils.pdl(cuda)
    monkeypatch.setenv("KESTREL_PDL", "0")
    assert not _utils.pdl(cuda)
    monkeypatch.delenv("KESTREL_PDL")
    monkeypatch.setattr(_utils, "_cuda_capability", lambda index: 8)  # Ampere: no griddepcontrol
    assert not _utils.pdl(cuda)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_utils, "_cuda_capability", lambda index: 9)
    assert not _utils.pdl(cuda)
