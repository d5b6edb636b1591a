"""bench/short_conv.py's helpers: the packed samples it draws and the per-sample reference it
checks the convolution ways against (timings need a GPU and are not taken here)."""

from __future__ import annotations

import torch

from bench import short_conv
from bench.gated_delta import linear_attention_shapes
from kestrel.kernels.short_conv import short_conv_reference


def test_the_drawn_samples_fill_each_row_within_their_bounds() -> None:
    offsets = short_conv.sample_offsets(3, 1000, seed=4, low=50, high=300)
    assert offsets.shape == (3, 1000)
    for row in offsets:
        starts = (row == 0).nonzero().flatten().tolist() + [1000]
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        assert starts[0] == 0 and all(n <= 300 for n in lengths) and all(n >= 50 for n in lengths[:-1])
        assert torch.equal(row, torch.cat([torch.arange(n) for n in lengths]))


def test_the_reference_runs_each_sample_alone_as_the_segmented_convolution_does() -> None:
    c, width = short_conv.channels(linear_attention_shapes()["qwen3.5-9b"])
    assert (c, width) == (8192, 4)
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 40, 6, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    offsets = short_conv.sample_offsets(2, 40, low=3, high=11)
    torch.testing.assert_close(short_conv.per_sample_reference(x, w, b, offsets),
                               short_conv_reference(x, w, b, "silu", offsets))
    whole = short_conv.ways(offsets)["hf"](x, w, b)  # one sample a row: differs after the first start
    assert not torch.allclose(whole, short_conv_reference(x, w, b, "silu", offsets))
