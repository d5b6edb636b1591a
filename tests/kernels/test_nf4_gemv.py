"""nf4_gemv (kernels/nf4_gemv.py): small-batch products over packed NF4 weights.

Dequantized values bit for bit (one-hot rows of x pick single weights out) against
`nf4.dequantize_reference` and bitsandbytes' own dequantize, products against the dequantized
weight in float64, odd shapes (N no multiple of a tile, K of several quant blocks and no multiple
of a step), M = 1, 2, 3, 8, 16, nested and plain absmax, fp16 and bf16, both lookups (byte pairs,
nibbles), with and without prefetch, stacked members equal to their separate products, biases, split-K at one row and more
(the tickets left zero), the measured plan (tiles, one row or not). CPU: Triton's interpreter.
GPU only: the gather-free PRMT lookup (inline PTX) on every path, at the 8B shapes too.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kestrel.kernels import nf4
from kestrel.kernels.decode import nf4_tiles
from kestrel.kernels.decode.nf4_gemv import (
    MAX_ROWS, NIBBLE, PRMT, Tiles, applies, code_pairs, dequantized, nf4_gemv, nf4_gemv_reference, nf4_weight,
)
from kestrel.kernels.decode.nf4_tiles import Plan, choose_tiles, measured_plan, store_plan, tile_cost
from tests.kernels.tolerance import assert_close

bnb_functional = pytest.importorskip("bitsandbytes.functional")

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# Tiles that reach every path on small shapes: one-row FMAs, tensor cores, split-K (3 splits of
# a K of 5 blocks: the last split partly past K) at 2-16 rows and at one, a row tile past N; all
# with the byte-pair lookup, FMA and DOT also with the nibble lookup; each path also with blocks
# loaded in two parts (with prefetch, and with pipelined stages: these compile to cp.async on the GPU).
FMA, DOT, SPLIT, SPLIT1 = Tiles(1, 8, 128, 1), Tiles(16, 32, 128, 1), Tiles(16, 16, 64, 3), Tiles(1, 4, 64, 3)
PARTS = [FMA._replace(parts=2), DOT._replace(parts=2, stages=3), SPLIT._replace(parts=2, prefetch=True),
         SPLIT1._replace(parts=2, stages=2), FMA._replace(groups=2), SPLIT1._replace(parts=2, groups=2)]
PATHS = [FMA, DOT, SPLIT, SPLIT1, FMA._replace(lookup=NIBBLE), DOT._replace(lookup=NIBBLE),
         FMA._replace(prefetch=True), SPLIT._replace(prefetch=True), SPLIT1._replace(prefetch=True), *PARTS]
PATH_IDS = ["fma", "dot", "split", "split1", "fma-nibble", "dot-nibble", "fma-prefetch", "split-prefetch",
            "split1-prefetch", "fma-parts", "dot-parts-stages", "split-parts-prefetch", "split1-parts-stages",
            "fma-groups", "split1-parts-groups"]


@pytest.fixture(autouse=True)
def _triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", "triton")


def _member(n: int, k: int, dtype: torch.dtype, nested: bool, seed: int, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1)  # scales vary by row
    packed, state = bnb_functional.quantize_4bit(w.to(DEVICE, dtype), blocksize=64, compress_statistics=nested,
                                                 quant_type="nf4")
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return packed, state, b


def _weight(sizes: tuple[int, ...], k: int, dtype: torch.dtype, nested: bool = True, bias: bool = False):
    members = [_member(n, k, dtype, nested, seed=i + 7 * k, bias=bias) for i, n in enumerate(sizes)]
    return nf4_weight(members, dtype), members


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _three_tiles(tiles: Tiles | None) -> tuple[int, int]:
    """Two members whose rows make three row tiles of `tiles` (the last partial) with the members'
    boundary inside the second: every case of a tile against N and member ends, at the fewest
    programs (the interpreter's cost grows with them)."""
    bn = 8 if tiles is None else tiles.block_n
    return bn + bn // 2 + 1, bn - 1 + (bn == 1)


def _one_hot(m: int, k: int, dtype: torch.dtype, first: int) -> torch.Tensor:
    """Row i is e_{(first + 37 i) mod k}: y[i] is that column of W, with nothing to round."""
    x = torch.zeros(m, k)
    x[torch.arange(m), (first + 37 * torch.arange(m)) % k] = 1.0
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("tiles", PATHS, ids=PATH_IDS)
def test_values_are_bitsandbytes_dequantization(dtype: torch.dtype, nested: bool, tiles: Tiles,
                                                poisoned: None) -> None:
    weight, members = _weight(_three_tiles(tiles), 320, dtype, nested)
    expected = torch.cat([bnb_functional.dequantize_4bit(p, s) for p, s, _ in members])  # (N, 320)
    assert torch.equal(expected, torch.cat([nf4.dequantize_reference(p, s, dtype) for p, s, _ in members]))
    assert torch.equal(dequantized(weight), expected)
    for first in (0, 101, 250):
        m = 1 if tiles.block_m == 1 else MAX_ROWS
        x = _one_hot(m, 320, dtype, first)
        cols = (first + 37 * torch.arange(m)) % 320
        assert torch.equal(nf4_gemv(x, weight, tiles), expected[:, cols].T), first


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("shape", [(50, 192), (29, 320)])  # N no multiple of a row tile; 3 and 5 blocks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_product_matches_dequantized_matmul(m: int, shape: tuple[int, int], dtype: torch.dtype,
                                            poisoned: None) -> None:
    n, k = shape
    weight, _ = _weight((n,), k, dtype, nested=m % 2 == 0)
    x = _x(m, k, dtype, seed=m)
    ref = (x.double() @ dequantized(weight).double().T).to(dtype)
    prefetch = [t._replace(prefetch=True) for t in ((FMA, SPLIT1) if m == 1 else (DOT, SPLIT))]
    parts = [t for t in PARTS if m == 1 or t.block_m > 1]
    one_row = (None, FMA, FMA._replace(lookup=NIBBLE), SPLIT1, DOT, *prefetch, *parts)
    for tiles in one_row if m == 1 else (None, DOT, SPLIT, *prefetch, *parts):
        y = nf4_gemv(x, weight, tiles)
        assert y.dtype == dtype and y.shape == (m, n) and not y.isnan().any()
        assert_close(y, ref)
    assert torch.equal(nf4_gemv_reference(x, weight), (x.float() @ dequantized(weight).float().T).to(dtype))


@pytest.mark.parametrize("tiles", [FMA, DOT, SPLIT, SPLIT1, *PARTS],
                         ids=["fma", "dot", "split", "split1", "fma-parts", "dot-parts", "split-parts", "split1-parts",
                              "fma-groups", "split1-parts-groups"])
def test_stacked_members_equal_separate_products(tiles: Tiles) -> None:
    """q/k/v as one launch: each member's rows equal that member's own product bit for bit (a
    row's sums do not depend on the other rows of its tile), for row tiles across member ends."""
    dtype, k = torch.bfloat16, 192
    bn = tiles.block_n  # three members, their ends inside row tiles, the last tile partial
    weight, members = _weight((bn + 1, bn // 2 + 1, bn - 1), k, dtype, bias=True)
    x = _x(1 if tiles.block_m == 1 else 5, k, dtype, seed=3)
    stacked = nf4_gemv(x, weight, tiles)
    assert stacked.shape == (x.shape[0], bn + 1 + bn // 2 + 1 + bn - 1)
    alone = [nf4_gemv(x, nf4_weight([mb], dtype), tiles) for mb in members]
    assert torch.equal(stacked, torch.cat(alone, dim=-1))
    ref = (x.double() @ dequantized(weight).double().T + torch.cat([b for _, _, b in members]).double()).to(dtype)
    assert_close(stacked, ref)


@pytest.mark.parametrize("m,tiles", [(8, SPLIT), (1, SPLIT1)], ids=["rows", "one-row"])
def test_split_k_leaves_tickets_zero_and_repeats_exactly(m: int, tiles: Tiles) -> None:
    weight, _ = _weight((50,), 320, torch.bfloat16)
    x = _x(m, 320, torch.bfloat16)
    first = nf4_gemv(x, weight, tiles)
    assert not weight.tickets.any()
    assert torch.equal(nf4_gemv(x, weight, tiles), first)  # deterministic: partials summed in split order


def test_code_pairs_hold_both_levels_of_each_byte() -> None:
    code = torch.linspace(-1, 1, 16)
    pairs = code_pairs(code)
    b = torch.arange(256)
    low, high = (pairs & 0xFFFFFFFF).to(torch.int32), (pairs >> 32).to(torch.int32)
    assert torch.equal(low.view(torch.float32), code[b >> 4]) and torch.equal(high.view(torch.float32), code[b & 15])


def test_tiles_that_do_not_fit_are_refused() -> None:
    weight, _ = _weight((24,), 128, torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit 2 rows"):
        nf4_gemv(_x(2, 128, torch.bfloat16), weight, FMA)
    with pytest.raises(ValueError, match="in blocks of 64"):
        nf4_gemv(_x(1, 128, torch.bfloat16), weight, Tiles(1, 4, 32, 1))
    bad_tiles = (FMA._replace(parts=4), FMA._replace(stages=0), FMA._replace(groups=3),
                 FMA._replace(groups=2, prefetch=True), DOT._replace(groups=2))
    for bad in bad_tiles:
        with pytest.raises(ValueError, match="do not fit"):
            nf4_gemv(_x(1, 128, torch.bfloat16), weight, bad)


def test_leading_dims_and_row_slices() -> None:
    """x (B, T, K) with a row stride (a slice of a wider buffer); y keeps the leading dims."""
    weight, _ = _weight((24,), 128, torch.bfloat16)
    wide = _x(6, 256, torch.bfloat16)
    x = wide[:, :128].view(2, 3, 128)
    y = nf4_gemv(x, weight)
    assert y.shape == (2, 3, 24)
    assert torch.equal(y, nf4_gemv(x.contiguous(), weight))


def test_reference_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, _ = _weight((24, 8), 128, torch.float16, bias=True)
    x = _x(3, 128, torch.float16)
    monkeypatch.setenv("KESTREL_KERNELS", "torch")
    assert not applies(x, weight)
    assert torch.equal(nf4_gemv(x, weight), nf4_gemv_reference(x, weight))


def test_rejects_what_it_cannot_read() -> None:
    weight, members = _weight((24,), 128, torch.bfloat16)
    assert applies(_x(16, 128, torch.bfloat16), weight) and applies(_x(2, 128, torch.bfloat16), weight)
    assert not applies(_x(17, 128, torch.bfloat16), weight)
    assert not applies(_x(1, 128, torch.bfloat16), weight)  # unmeasured: the decode path keeps bitsandbytes' GEMV
    assert not applies(_x(2, 128, torch.float16), weight)
    with pytest.raises(ValueError, match="1-16 rows"):
        nf4_gemv(_x(17, 128, torch.bfloat16), weight)
    odd = _member(8, 96, torch.bfloat16, nested=True, seed=1)  # rows of 1.5 quant blocks
    with pytest.raises(ValueError, match="multiple of the power-of-two blocksize"):
        nf4_weight([odd], torch.bfloat16)
    with pytest.raises(ValueError, match="differ in in_features"):
        nf4_weight([members[0], _member(8, 192, torch.bfloat16, nested=True, seed=2)], torch.bfloat16)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        nf4_weight(members, torch.float32)


@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (50, 192), (2560, 9728)])
def test_tile_choice_follows_the_cost_model(m: int, shape: tuple[int, int]) -> None:
    n, k = shape
    t = choose_tiles(m, n, k, 64, 132)
    assert t.block_m == (1 if m == 1 else MAX_ROWS) and t.block_k % 64 == 0
    assert t.block_n * t.block_k <= 64 * 32 * t.warps  # decoded values per thread bounded
    assert t.split == 1 or k // t.block_k >= 2 * t.split
    # No other candidate is cheaper under the model (it is a minimum, not a fitted constant).
    for other in (t._replace(split=max(1, t.split // 2)), t._replace(block_n=max(1, t.block_n // 2))):
        if other.block_m == 1 or other.block_n >= 16:
            assert tile_cost(t, m, n, k, 132) <= tile_cost(other, m, n, k, 132)


def test_measured_plan_round_trips_and_picks_rows(tmp_path) -> None:
    """The sweep's table: stored per device and (N, K), read back; a row count takes the tiles
    measured at the fewest rows at or above it on its own path."""
    table = tmp_path / "tiles.json"
    one, two, eight = Tiles(1, 4, 1024, 2, 4), Tiles(16, 32, 128, 4, lookup=PRMT), Tiles(16, 64, 128, 2, 8, lookup=NIBBLE)
    plan = Plan(((1, one), (2, two), (8, eight)), kernel_one_row=True)
    store_plan("GPU A", 6144, 4096, plan, table)
    store_plan("GPU A", 4096, 4096, Plan(((2, two),), kernel_one_row=False), table)
    assert measured_plan("GPU A", 6144, 4096, table) == plan
    assert measured_plan("GPU B", 6144, 4096, table) is None and measured_plan("GPU A", 6144, 8, table) is None
    assert [plan.for_rows(m) for m in (1, 2, 3, 8, 16)] == [one, two, eight, eight, None]
    assert Plan(((2, two),), False).for_rows(1) is None
    table.write_text("{not json")
    nf4_tiles._read.cache_clear()
    with pytest.raises(ValueError, match="tiles.json: not valid JSON"):
        measured_plan("GPU A", 6144, 4096, table)


def test_measured_plan_decides_one_row_and_tiles() -> None:
    """A plan that measured the kernel faster at one row lets `applies` take one row; its tiles
    are the ones launched (a plan whose tiles cannot fit would raise)."""
    weight, _ = _weight((24,), 128, torch.bfloat16)
    x1 = _x(1, 128, torch.bfloat16)
    assert weight.min_rows == 2 and not applies(x1, weight)
    plan = Plan(((1, SPLIT1), (16, SPLIT)), kernel_one_row=True)
    measured = dataclasses.replace(weight, plan=plan, min_rows=1)
    assert applies(x1, measured) and measured.tiles_for(1) == SPLIT1 and measured.tiles_for(5) == SPLIT
    assert measured.tiles_for(1) != weight.tiles_for(1)
    assert torch.equal(nf4_gemv(x1, measured), nf4_gemv(x1, weight, SPLIT1))
    bad = dataclasses.replace(weight, plan=Plan(((1, Tiles(1, 4, 32, 1)),), True))
    with pytest.raises(ValueError, match="do not fit"):
        nf4_gemv(x1, bad)


@pytest.mark.parametrize("measured", [True, False], ids=["measured", "cost-model"])
def test_tile_choice_traces_with_a_symbolic_row_count(measured: bool) -> None:
    """A compiled decode step sees the batch as a symbolic size once it has run two sizes; the tile
    choice must trace (a bool compared with a SymBool failed on the H200) and pick what it picks eagerly."""
    weight, _ = _weight((24,), 128, torch.bfloat16)
    if measured:
        weight = dataclasses.replace(weight, plan=Plan(((1, SPLIT1), (16, SPLIT)), kernel_one_row=True), min_rows=1)

    def block_n(x: torch.Tensor) -> torch.Tensor:
        return x + weight.tiles_for(x.shape[0]).block_n

    torch._dynamo.reset()
    compiled = torch.compile(block_n, backend="eager", fullgraph=True, dynamic=True)
    for m in (1, 3, 9, 16):
        x = torch.zeros(m)
        assert torch.equal(compiled(x), block_n(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("tiles", PATHS[:4] + PATHS[6:], ids=PATH_IDS[:4] + PATH_IDS[6:])
def test_cuda_prmt_lookup_is_exact_on_every_path(dtype: torch.dtype, nested: bool, tiles: Tiles) -> None:
    """The register-table lookup: bitsandbytes' values bit for bit (one-hot rows), products at 1-16 rows
    against the dequantized weight in fp64, stacked members (bias, row tiles across member ends)
    equal to their separate launches, split-K tickets left zero."""
    tiles = tiles._replace(lookup=PRMT)
    weight, members = _weight((37, 24, 17), 320, dtype, nested, bias=True)
    assert weight.register_table  # the PRMT lookup runs, not the NIBBLE fallback
    expected = torch.cat([bnb_functional.dequantize_4bit(p, s) for p, s, _ in members])  # (78, 320)
    nobias = dataclasses.replace(weight, bias=None)
    for first in (0, 101, 250):
        m = 1 if tiles.block_m == 1 else MAX_ROWS
        cols = (first + 37 * torch.arange(m)) % 320
        assert torch.equal(nf4_gemv(_one_hot(m, 320, dtype, first), nobias, tiles), expected[:, cols].T), first
    bias = torch.cat([b for _, _, b in members]).double()
    for m in (1,) if tiles.block_m == 1 else (1, 2, 8, 16):
        x = _x(m, 320, dtype, seed=m)
        y = nf4_gemv(x, weight, tiles)
        assert_close(y, (x.double() @ expected.double().T + bias).to(dtype))
        alone = [nf4_gemv(x, nf4_weight([mb], dtype), tiles) for mb in members]
        assert torch.equal(y, torch.cat(alone, dim=-1))
    assert not weight.tickets.any()


@pytest.mark.gpu
@pytest.mark.parametrize("lookup", [None, PRMT], ids=["planned", "prmt"])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("sizes,k", [((4096, 1024, 1024), 4096), ((4096,), 4096), ((14336, 14336), 4096),
                                     ((4096,), 14336)], ids=["qkv", "o", "gate_up", "down"])
def test_cuda_8b_shapes_match_dequantize_and_matmul(m: int, sizes: tuple[int, ...], k: int, lookup: int | None) -> None:
    """The 8B decode shapes (q/k/v and gate/up grouped) with the tiles the decode path takes (the measured
    plan where there is one), or those tiles with the PRMT lookup (at one row also the tensor-core tiles)."""
    dtype = torch.bfloat16
    members = []
    for i, n in enumerate(sizes):
        w = torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5
        packed, state = bnb_functional.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
        members.append((packed, state, None))
    weight = nf4_weight(members, dtype)
    w16 = torch.cat([bnb_functional.dequantize_4bit(p, s) for p, s, _ in members])  # bitsandbytes' CUDA kernel
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    ref = x.double() @ w16.double().T
    cols = torch.randint(0, k, (m,), device="cuda")
    hot = torch.zeros(m, k, device="cuda", dtype=dtype)
    hot[torch.arange(m), cols] = 1.0
    tiles = [None] if lookup is None else [weight.tiles_for(r)._replace(lookup=lookup) for r in {m, max(m, 2)}]
    assert lookup is None or weight.register_table
    for t in tiles:
        y = nf4_gemv(x, weight, t)
        assert_close(y, ref.to(dtype))
        torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=2**-7 * float(ref.abs().max()) / 16)
        assert torch.equal(nf4_gemv(hot, weight, t), w16[:, cols].T), t  # the values, bit for bit
        assert not weight.tickets.any()
