"""NF4 dequantization (kernels/nf4.py) against bitsandbytes' own dequantize and a packed format
built by hand from the NF4 code table; the Triton kernel runs through the interpreter on CPU."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from kestrel.kernels import nf4

bnb_functional = pytest.importorskip("bitsandbytes.functional")

# Odd shapes: a partial last block (5 x 123 = 615 elements, an odd count: half a byte unused),
# more blocks than one program covers (37 x 64 * 2 > 32 blocks), and a nested block boundary
# (>256 blocks, so two second-level scales).
SHAPES = [(5, 123), (37, 128), (130, 136)]

# Triton's CPU interpreter truncates fp32 -> bf16 where compiled Triton (and bitsandbytes) round
# to nearest even, so interpreted bf16 output can be 1 ulp low; fp32/fp16 stay exact there, and
# the GPU test checks bf16 bit for bit.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _assert_equal(got: torch.Tensor, expected: torch.Tensor, backend: str) -> None:
    if backend == "triton" and INTERPRETED and got.dtype == torch.bfloat16:
        torch.testing.assert_close(got, expected, rtol=2.0**-7, atol=0)  # at most one bf16 ulp
    else:
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _quantize(
    shape: tuple[int, int], dtype: torch.dtype, nested: bool, seed: int = 0, device: str = "cpu"
):
    gen = torch.Generator().manual_seed(seed)
    # Rows with different scales so the per-block absmax really varies.
    w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen).add(0.1)
    return bnb_functional.quantize_4bit(
        w.to(device=device, dtype=dtype), blocksize=64, compress_statistics=nested, quant_type="nf4"
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nested", [True, False])
def test_matches_bitsandbytes_exactly(backend: str, shape: tuple[int, int], nested: bool) -> None:
    packed, state = _quantize(shape, torch.bfloat16, nested)
    assert state.nested == nested
    expected = bnb_functional.dequantize_4bit(packed, state)  # bitsandbytes' CPU backend
    out = torch.full(shape, float("nan"), dtype=torch.bfloat16)  # poison: unwritten shows
    got = nf4.dequantize(packed, state, out=out)
    assert got.data_ptr() == out.data_ptr()
    _assert_equal(got, expected, backend)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_match_bitsandbytes(backend: str, dtype: torch.dtype) -> None:
    packed, state = _quantize((37, 128), dtype, nested=True, seed=1)
    expected = bnb_functional.dequantize_4bit(packed, state)
    torch.testing.assert_close(nf4.dequantize(packed, state), expected, rtol=0, atol=0)


def test_fp32_output_of_bf16_state_is_exact(backend: str) -> None:
    # The kernel's fp32 math (nested absmax, no FMA, table lookup) against the reference.
    packed, state = _quantize((130, 136), torch.bfloat16, nested=True, seed=4)
    expected = nf4.dequantize_reference(packed, state, torch.float32)
    got = nf4.dequantize(packed, state, dtype=torch.float32)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _hand_packed(nibbles: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int]):
    """Pack (n,) nibbles, first of each pair in the high half, with plain fp32 absmax."""
    padded = torch.cat([nibbles, nibbles.new_zeros(nibbles.numel() % 2)])
    packed = (padded[0::2] << 4 | padded[1::2]).to(torch.uint8)
    state = SimpleNamespace(
        absmax=absmax, shape=torch.Size(shape), dtype=torch.float32, blocksize=64,
        quant_type="nf4", nested=False, code=None,
    )  # fmt: skip
    return packed, state


def test_hand_built_format(backend: str) -> None:
    # Independent of bitsandbytes: W[i] = NF4[nibble_i] * absmax[i // 64].
    shape = (3, 50)  # 150 elements: 3 blocks, the last one partial
    gen = torch.Generator().manual_seed(2)
    nibbles = torch.randint(0, 16, (150,), generator=gen)
    absmax = torch.tensor([0.5, 2.0, 3.25])
    packed, state = _hand_packed(nibbles, absmax, shape)
    table = torch.tensor(nf4.NF4_CODE)
    expected = (table[nibbles] * absmax.repeat_interleave(64)[:150]).view(shape)
    out = torch.full(shape, float("nan"))
    torch.testing.assert_close(nf4.dequantize(packed, state, out=out), expected, rtol=0, atol=0)


def test_code_table_is_bitsandbytes_nf4() -> None:
    table = bnb_functional.get_4bit_type("nf4", device="cpu")
    assert torch.equal(table, torch.tensor(nf4.NF4_CODE, dtype=torch.float32))


def test_workspace_is_reused(backend: str) -> None:
    nf4.WORKSPACE.clear()
    big, big_state = _quantize((37, 128), torch.bfloat16, nested=True)
    small, small_state = _quantize((5, 123), torch.bfloat16, nested=True, seed=3)
    first = nf4.dequantize(big, big_state)
    ptr, generation = first.data_ptr(), nf4.WORKSPACE.generation
    expected_small = bnb_functional.dequantize_4bit(small, small_state)
    second = nf4.dequantize(small, small_state)  # smaller: a view at the start of the buffer
    assert second.data_ptr() == ptr and second.shape == (5, 123)
    _assert_equal(second, expected_small, backend)
    assert nf4.dequantize(big, big_state).data_ptr() == ptr
    assert nf4.WORKSPACE.generation == generation  # reused: CUDA graphs that read it stay valid
    # Another dtype gets its own buffer.
    assert nf4.dequantize(big, big_state, dtype=torch.float32).data_ptr() != ptr
    assert nf4.WORKSPACE.generation == generation + 1


def test_rejects_other_formats() -> None:
    packed, state = _quantize((5, 123), torch.bfloat16, nested=False)
    with pytest.raises(ValueError, match="out must be contiguous"):
        nf4.dequantize(packed, state, out=torch.empty(123, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="only NF4"):
        nf4.dequantize(packed, SimpleNamespace(**{**vars(state), "quant_type": "fp4"}))
    with pytest.raises(ValueError, match="uint8"):
        nf4.dequantize(packed.float(), state)


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [True, False])
def test_cuda_triton_matches_bitsandbytes(nested: bool) -> None:
    packed, state = _quantize((1000, 1000), torch.bfloat16, nested, device="cuda")
    expected = bnb_functional.dequantize_4bit(packed, state)
    out = torch.full_like(expected, float("nan"))
    torch.testing.assert_close(nf4.dequantize(packed, state, out=out), expected, rtol=0, atol=0)


def test_cached_launch_plan_follows_the_weight(backend: str) -> None:
    # The launch plan is cached on the quant_state: another packed tensor, or a copied state of
    # another format, must not reuse it.
    packed, state = _quantize((37, 128), torch.bfloat16, nested=True, seed=4)
    other, _ = _quantize((37, 128), torch.bfloat16, nested=True, seed=5)
    first = nf4.dequantize(packed, state).clone()
    _assert_equal(first, bnb_functional.dequantize_4bit(packed, state), backend)
    _assert_equal(nf4.dequantize(other, state), nf4.dequantize_reference(other, state), backend)
    assert not torch.equal(nf4.dequantize(other, state), first)
    _assert_equal(nf4.dequantize(packed, state), first, backend)
    with pytest.raises(ValueError, match="only NF4"):
        nf4.dequantize(packed, SimpleNamespace(**{**vars(state), "quant_type": "fp4"}))
