"""expert_gemv (kernels/decode/expert_gemv.py): a decode step's expert products read in place, against
the gathered slices times x (`gathered_products`, the path it replaces) and against float64 products
of the same weights. Both stored layouts ((E, out, in) Qwen3-MoE, (E, in, out) gpt-oss), 16-bit and
fp32 weights, NF4 with nested and plain absmax (one-hot rows of x pick single weights out: bitsandbytes'
values bit for bit), 1-9 pairs with repeated experts, shapes no multiple of a tile, NF4 experts that
are not whole quant blocks, the fallbacks. CPU: Triton's interpreter. GPU only: the real shapes,
inside a CUDA graph.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kestrel.kernels import nf4
from kestrel.kernels.decode import expert_gemv as module
from kestrel.kernels.decode.expert_gemv import (
    _SECTOR_BITS, _TILE_VALUES, _WAVES, ExpertTiles, expert_gemv, expert_products, expert_tiles, expert_weights, gathered_products,
)
from kestrel.kernels.moe import PackedExperts
from tests.kernels.tolerance import assert_close

pytest.importorskip("bitsandbytes.functional")

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
E, IN, OUT = 5, 72, 40  # no multiple of any tile; each expert's 72 * 40 values are 45 whole quant blocks
KINDS = {  # name: (dtype, NF4, nested absmax)
    "bf16": (torch.bfloat16, False, False), "fp16": (torch.float16, False, False), "fp32": (torch.float32, False, False),
    "nf4-bf16": (torch.bfloat16, True, True), "nf4-fp32": (torch.float32, True, True),
    "nf4-fp16-plain": (torch.float16, True, False),
}


@pytest.fixture(autouse=True)
def _triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", "triton")


def _stored(kind: str, transposed: bool, shape: tuple[int, int, int] = (E, IN, OUT), seed: int = 0):
    """Experts in the stored layout ((E, in, out) when transposed, else (E, out, in)) and their values
    as the products read them (NF4: dequantized, bitsandbytes' reference)."""
    dtype, is_nf4, nested = KINDS[kind]
    e, k, n = shape
    gen = torch.Generator(DEVICE).manual_seed(seed)
    w = (torch.randn((e, k, n) if transposed else (e, n, k), generator=gen, device=DEVICE) * 0.1).to(dtype)
    if not is_nf4:
        return w, w
    packed = PackedExperts(w, transposed, nested=nested)
    assert packed.state.nested == nested
    return packed, nf4.dequantize_reference(packed.packed, packed.state).view(w.shape)


def _ids(m: int, seed: int, e: int = E) -> torch.Tensor:
    ids = torch.randint(0, e, (m,), generator=torch.Generator().manual_seed(seed))
    if m > 2:
        ids[m - 1] = ids[0]  # an expert chosen twice
    return ids.to(DEVICE)


def _fp64_products(x: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, transposed: bool) -> torch.Tensor:
    w = values[ids].double()
    return torch.bmm(x.double()[:, None], w if transposed else w.transpose(1, 2))[:, 0]


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_equals_the_gathered_products(kind: str, transposed: bool) -> None:
    source, values = _stored(kind, transposed)
    weights = expert_weights(source, transposed)
    assert not weights.reason
    # the launch's own tiles (one program a pair when interpreted), and tiles that leave partial
    # output tiles (40 = 16 + 16 + 8) and partial reduction steps (72 = 32 + 32 + 8)
    for m, tiles in ((1, None), (9, ExpertTiles(16, 32))):
        ids = _ids(m, seed=m)
        x = torch.randn(m, IN, generator=torch.Generator().manual_seed(m)).to(DEVICE, values.dtype)
        y = expert_gemv(x, ids, weights, tiles)
        assert y.shape == (m, OUT) and y.dtype == values.dtype
        ref = gathered_products(x, ids, source, transposed)
        assert_close(y, ref)
        assert_close(y, _fp64_products(x, ids, values, transposed).to(values.dtype))


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
@pytest.mark.parametrize("kind", ["nf4-fp32", "nf4-bf16"])
def test_nf4_rows_of_whole_quant_blocks_decode_a_scale_a_group(kind: str, transposed: bool) -> None:
    """Rows of 192 or 128 values (whole 64-blocks): each group of a tile row's bytes takes one decoded
    scale. Tiles of several groups (a K step of 128 values, partly past K = 192; a 128-wide output tile)
    and the launch's own."""
    in_, out = 192, 128
    source, values = _stored(kind, transposed, shape=(4, in_, out), seed=9)
    weights = expert_weights(source, transposed)
    for m, tiles in ((5, ExpertTiles(128, 16) if transposed else ExpertTiles(16, 128)), (2, None)):
        ids = _ids(m, seed=10 + m, e=4)
        x = torch.randn(m, in_, generator=torch.Generator().manual_seed(m)).to(DEVICE, values.dtype)
        y = expert_gemv(x, ids, weights, tiles)
        assert_close(y, _fp64_products(x, ids, values, transposed).to(values.dtype))
        assert_close(y, gathered_products(x, ids, source, transposed))


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
def test_nf4_values_are_bitsandbytes_bit_for_bit(transposed: bool) -> None:
    """One-hot rows: y[p] is row k of expert e[p]'s (in, out) weights, rounded to bf16 from the fp32
    code * absmax exactly as `PackedExperts.select` and bitsandbytes' dequantize round it. Rows of
    +-1: sums of 72 bf16 values within a few binades are exact in fp32, so y is the float64 product
    of the rounded weights, rounded once (weights not rounded before the multiply would miss it)."""
    source, values = _stored("nf4-bf16", transposed, seed=3)
    read = values if transposed else values.transpose(1, 2)  # (E, in, out)
    ids = _ids(8, seed=4)
    ks = (torch.arange(8) * 11 + 5) % IN
    x = torch.zeros(8, IN, dtype=torch.bfloat16, device=DEVICE)
    x[torch.arange(8), ks] = 1.0
    y = expert_gemv(x, ids, expert_weights(source, transposed))
    assert torch.equal(y, read[ids, ks.to(DEVICE)])
    assert torch.equal(source.select(ids), values[ids])  # the reference's own values
    signs = torch.randint(0, 2, (8, IN), generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16) * 2 - 1
    y = expert_gemv(signs, ids, expert_weights(source, transposed))
    assert torch.equal(y, _fp64_products(signs, ids, values, transposed).to(torch.bfloat16))


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
def test_nf4_experts_that_are_not_whole_quant_blocks(transposed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 x 18 values an expert: quant blocks straddle experts. The kernel reads them by their flat
    index; the fallback dequantizes the whole tensor."""
    source, values = _stored("nf4-fp32", transposed, shape=(3, 40, 18), seed=5)
    assert not source.selectable
    ids, x = _ids(4, seed=6, e=3), torch.randn(4, 40, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ref = _fp64_products(x, ids, values, transposed).float()
    weights = expert_weights(source, transposed)
    assert_close(expert_products(x, ids, weights), ref)
    monkeypatch.setenv("KESTREL_KERNELS", "torch")
    assert_close(expert_products(x, ids, weights), ref)


def test_what_the_kernel_cannot_read_takes_the_gathered_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """NF4 rows of an odd length (a byte across two rows) and the PyTorch backend: `gathered_products`,
    never the kernel."""
    launches: list[int] = []
    kernel = module.expert_gemv
    monkeypatch.setattr(module, "expert_gemv", lambda x, ids, w: launches.append(1) or kernel(x, ids, w))
    odd, odd_values = _stored("nf4-fp32", False, shape=(2, 64, 3), seed=7)  # (E, out=3, in=64): rows of 64 values
    odd_t, odd_t_values = _stored("nf4-fp32", True, shape=(2, 64, 3), seed=7)  # (E, in=64, out=3): rows of 3
    ids, x = _ids(3, seed=8, e=2), torch.randn(3, 64, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    assert not expert_weights(odd, False).reason
    assert "split bytes" in expert_weights(odd_t, True).reason
    assert_close(expert_products(x, ids, expert_weights(odd_t, True)), _fp64_products(x, ids, odd_t_values, True).float())
    assert not launches
    assert_close(expert_products(x, ids, expert_weights(odd, False)), _fp64_products(x, ids, odd_values, False).float())
    assert len(launches) == 1
    monkeypatch.setenv("KESTREL_KERNELS", "torch")
    assert_close(expert_products(x, ids, expert_weights(odd, False)), _fp64_products(x, ids, odd_values, False).float())
    assert len(launches) == 1


@pytest.mark.parametrize("k_contig", [True, False])
@pytest.mark.parametrize("bits", [16, 4])
@pytest.mark.parametrize("m", [1, 4, 8, 64])
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768), (5760, 2880), (2880, 2880), (40, 72)])
def test_tiles_follow_the_cost_model(n: int, k: int, m: int, bits: int, k_contig: bool) -> None:
    """Powers of two, at most _TILE_VALUES weights a step; K contiguous: the longest run along K;
    N contiguous: a tile row spans a DRAM sector (unless N is shorter); at least _WAVES programs an
    SM unless the output tile is at its floor, and the output tile no smaller than that needs."""
    sms = 132
    t = expert_tiles(m, n, k, k_contig, bits, sms)
    assert all(b & (b - 1) == 0 for b in t) and t.block_n * t.block_k <= _TILE_VALUES
    pow2_n = 1 << (n - 1).bit_length()
    if k_contig:
        assert t.block_k == min(1 << (k - 1).bit_length(), _TILE_VALUES // 2)
        floor_n = 2
    else:
        floor_n = min(_SECTOR_BITS // bits, pow2_n)
        assert t.block_n >= floor_n
    assert m * -(-n // t.block_n) >= _WAVES * sms or t.block_n == floor_n
    if t.block_n < min(pow2_n, _TILE_VALUES // (t.block_k if k_contig else 2)):  # halved: it had to be
        assert m * -(-n // (2 * t.block_n)) < _WAVES * sms


def test_kernel_compiles_for_sm90() -> None:
    """Every variant (16-bit and NF4, both layouts, nested and plain absmax) through Triton and ptxas for
    an H100/H200 (no GPU needed; its own process, uninterpreted: the interpreter runs what the compiler
    refuses). A nested absmax's offset add is PTX `add.rn.f32` (never fused into an FMA); a plain one has none."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.support.sm90_compile", "expert"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    adds = [int(c) for c in done.stdout.split()[-6:]]
    assert adds[:2] == [0, 0] and adds[2] > 0 and adds[3] > 0 and adds[4:] == [0, 0]


# --- CUDA: the real shapes, in a CUDA graph ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "nf4-bf16"])
@pytest.mark.parametrize("shape,transposed,top_k", [
    ((128, 2048, 2 * 768), False, 8), ((128, 768, 2048), False, 8),  # Qwen3-30B-A3B gate_up, down
    ((32, 2880, 2 * 2880), True, 4), ((32, 2880, 2880), True, 4),  # gpt-oss-20b gate_up, down
], ids=["qwen3-gate_up", "qwen3-down", "gpt-oss-gate_up", "gpt-oss-down"])
def test_cuda_real_shapes_and_graph_replay(kind: str, shape: tuple[int, int, int], transposed: bool, top_k: int) -> None:
    source, values = _stored(kind, transposed, shape=shape, seed=11)
    weights = expert_weights(source, transposed)
    e, k, n = shape
    for rows in (1, 8):
        m = rows * top_k
        ids = torch.randint(0, e, (m,), device="cuda")
        ids[-1] = ids[0]
        x = torch.randn(m, k, device="cuda", dtype=values.dtype)
        y = expert_gemv(x, ids, weights)
        assert_close(y, gathered_products(x, ids, source, transposed))
        assert_close(y, _fp64_products(x, ids, values, transposed).to(values.dtype))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = expert_gemv(x, ids, weights)
        ids.copy_(torch.randint(0, e, (m,), device="cuda"))  # new experts, same buffers
        x.copy_(torch.randn(m, k, device="cuda", dtype=values.dtype))
        graph.replay()
        assert torch.equal(captured, expert_gemv(x, ids, weights))
        assert_close(captured, _fp64_products(x, ids, values, transposed).to(values.dtype))
