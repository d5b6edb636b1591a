"""short_conv (a linear-attention layer's short causal convolution, each packed sample on its own)
against F.conv1d run on each sample alone: output, dx, dweight and dbias, through the Triton
kernels (the CPU interpreter here, CUDA on the GPU machine) and the torch reference."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

from kestrel.kernels import short_conv
from kestrel.kernels.short_conv import BLOCK_C, BLOCK_T, _rows_per_program
from tests.kernels.tolerance import assert_close

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _alone(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool,
           lengths: list[list[int]] | None) -> torch.Tensor:
    """F.conv1d over each sample alone (zeros before its first token), laid out as x, in fp64."""
    x64, w64 = x.double(), weight.double()
    b64 = bias.double() if bias is not None else None
    rows = []
    for i in range(x.shape[0]):
        parts = []
        for part in x64[i : i + 1].split(lengths[i] if lengths else [x.shape[1]], dim=1):
            y = F.conv1d(part.transpose(1, 2), w64[:, None], b64, padding=weight.shape[-1] - 1,
                         groups=x.shape[-1])[..., : part.shape[1]]
            parts.append((F.silu(y) if silu else y).transpose(1, 2))
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


# (B, T, C, width, samples per row): channels that fill no block evenly, tokens over several
# tiles, one-token samples, widths below 4 (a padded tap count) and above (5).
CASES = [
    (2, 37, 96, 4, [[9, 1, 20, 7], [37]]),
    (1, 50, 300, 3, [[2, 2, 46]]),
    (3, 19, 40, 2, None),
    (1, 41, 33, 5, [[4, 30, 7]]),
]


def _check_against_alone(batch: int, t: int, c: int, width: int, lengths: list[list[int]] | None, bias: bool,
                         silu: bool, dtype: torch.dtype) -> None:
    """short_conv's output and gradients against `_alone`'s, for random inputs of this shape."""
    gen = torch.Generator().manual_seed(t * c + width)
    x = torch.randn(batch, t, c, generator=gen)
    weight, b = torch.randn(c, width, generator=gen) * 0.5, torch.randn(c, generator=gen) if bias else None
    grad = torch.randn(batch, t, c, generator=gen)
    offsets = None if lengths is None else torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    want = _alone(x.requires_grad_(), weight.requires_grad_(), b.requires_grad_() if bias else None, silu, lengths)
    leaves = [x, weight] + ([b] if bias else [])
    want_grads = torch.autograd.grad(want, leaves, grad.double())

    xs, ws = x.detach().to(DEVICE, dtype).requires_grad_(), weight.detach().to(DEVICE, dtype).requires_grad_()
    bs = b.detach().to(DEVICE, dtype).requires_grad_() if bias else None
    got = short_conv(xs, ws, bs, "silu" if silu else None, None if offsets is None else offsets.to(DEVICE))
    got_grads = torch.autograd.grad(got, [xs, ws] + ([bs] if bias else []), grad.to(DEVICE, dtype))
    assert_close(got.cpu(), want.to(dtype))
    for g_got, g_want in zip(got_grads, want_grads):  # dW and db sum over tokens: bf16 rounds once at the end
        assert_close(g_got.cpu(), g_want.to(dtype))


@pytest.mark.parametrize(("batch", "t", "c", "width", "lengths"), CASES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_is_each_samples_own_convolution(backend: str, poisoned: None, batch: int, t: int, c: int,
                                                    width: int, lengths: list[list[int]] | None, bias: bool,
                                                    silu: bool, dtype: torch.dtype) -> None:
    _check_against_alone(batch, t, c, width, lengths, bias, silu, dtype)


@pytest.mark.parametrize("width", [2, 4, 5])
@pytest.mark.parametrize("silu", [True, False])
def test_backward_reads_no_gradient_across_samples_rows_or_programs(poisoned: None, monkeypatch: pytest.MonkeyPatch,
                                                                     width: int, silu: bool) -> None:
    """The backward reads d (or dy) at the w-1 tokens after each token: never past its sample's
    end, also where that end is a row's last token (a one-token sample, then the next row's
    first, itself one token long), and where a program's run of rows or a tile ends mid-sample.
    One tile's rows a program, so the 72 rows make 5 programs a column block."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    module = importlib.import_module("kestrel.kernels.short_conv")  # the package's `short_conv` is the function
    programs: list[int] = []

    def one_tile_each(n_rows: int, n_cols: int, sms: int) -> int:
        programs.append(-(-n_rows // BLOCK_T))
        return BLOCK_T

    monkeypatch.setattr(module, "_rows_per_program", one_tile_each)
    # Flat rows 0..71: samples end at 9, 22, 23 | 24, 44, 47 | 71; tiles and programs start every
    # 16 rows (16, 32 and 64 are mid-sample), the backward's walk every BWD_T = 8 (8, 40, 56 too).
    _check_against_alone(3, 24, 40, width, [[10, 13, 1], [1, 20, 3], [24]], True, silu, torch.float32)
    assert programs == [5]


def test_one_row_of_offsets_stands_for_every_row(backend: str) -> None:
    """Offsets of shape (1, T), as position ids sometimes come unexpanded: each row is split alike."""
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(3, 20, 40, generator=gen).to(DEVICE), torch.randn(40, 4, generator=gen).to(DEVICE)
    one = torch.cat([torch.arange(7), torch.arange(13)])[None].to(DEVICE)
    assert_close(short_conv(x, weight, None, "silu", one), short_conv(x, weight, None, "silu", one.expand(3, -1)))
    assert_close(short_conv(x, weight, None, "silu", one).cpu(), _alone(x.cpu(), weight.cpu(), None, True, [[7, 13]] * 3).float())


def test_short_conv_refuses_an_activation_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="gelu"):
        short_conv(torch.zeros(1, 3, 2), torch.zeros(2, 4), None, "gelu")


@pytest.mark.parametrize(("rows", "cols", "sms"), [(4096, 8192, 132), (37, 96, 4), (1, 33, 4), (100_000, 256, 78)])
def test_backward_programs_cover_every_row_in_whole_tiles(rows: int, cols: int, sms: int) -> None:
    per = _rows_per_program(rows, cols, sms)
    assert per % BLOCK_T == 0 and per >= BLOCK_T
    programs = -(-rows // per)
    assert programs * per >= rows > (programs - 1) * per
    assert programs * -(-cols // BLOCK_C) <= max(4 * sms, -(-cols // BLOCK_C))  # few partial rows to sum
