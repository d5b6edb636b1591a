"""NF4 dequantization with the LoRA update merged in (kestrel.kernels.nf4_lora), and the fused LoRA
projections over it: W' = W + s B A against fp32 math, and lora_mlp / lora_qkv on merged bases
against fp32 PEFT math on the dequantized weights, outputs and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels.lora import lora as lora_module
from kestrel.kernels import nf4
from kestrel.kernels.lora import nf4_lora
from kestrel.kernels.lora.lora import LoRAWeights, lora_qkv
from kestrel.kernels.lora.mlp import lora_mlp
from tests.kernels.test_lora import _close, _run

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

HIDDEN, INTER, KV = 128, 192, 64  # whole 64-element quant blocks per row: every base merges


@pytest.fixture(autouse=True)
def _fresh_workspace() -> None:
    nf4.WORKSPACE.clear()


def _quantized(out: int, inp: int, nested: bool = True) -> tuple[torch.Tensor, object]:
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(out * inp)) / inp**0.5
    return bnb.functional.quantize_4bit(w, quant_type="nf4", compress_statistics=nested)


@pytest.mark.parametrize("shape", [(80, 128), (33, 256), (100, 192)])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("rank", [5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_dequantize_matches_fp32_math(
    backend: str, poisoned: None, shape: tuple[int, int], nested: bool, rank: int, dtype: torch.dtype
) -> None:
    packed, state = _quantized(*shape, nested)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(rank, shape[1], generator=gen), torch.randn(shape[0], rank, generator=gen)
    assert nf4_lora.usable(state)
    got = nf4_lora.dequantize_merged(packed, state, a, b, 0.7, dtype)
    w = nf4.dequantize_reference(packed, state, torch.float64)
    exact = w + 0.7 * (b.double() @ a.double())
    assert got.dtype == dtype and got.shape == shape and not got.isnan().any()
    # fp32 sums of the rank-r products (a few fp32 ulps of the terms' magnitudes), then one
    # rounding to dtype.
    terms = 0.7 * (b.double().abs() @ a.double().abs())
    fp32_sums = 8 * 2.0**-24 * (w.abs() + terms)
    last_place = 2.0**-23 if dtype == torch.float32 else 2.0**-7  # a unit: the interpreter may truncate
    # A 16-bit W' takes A and B rounded to 16 bits (a unit each, for the same reason).
    operands = 0.0 if dtype == torch.float32 else 2 * 2.0**-7 * terms
    assert ((got.double() - exact).abs() <= last_place * exact.abs() + fp32_sums + operands).all()


def test_zero_b_is_the_plain_dequantization(backend: str) -> None:
    packed, state = _quantized(80, 128)
    a, b = torch.randn(16, 128), torch.zeros(80, 16)
    got = nf4_lora.dequantize_merged(packed, state, a, b, 2.0, torch.bfloat16).clone()
    assert torch.equal(got, nf4.dequantize(packed, state, dtype=torch.bfloat16))  # same backend


def test_usable_needs_rows_of_whole_quant_blocks() -> None:
    assert nf4_lora.usable(_quantized(8, 128)[1]) and nf4_lora.usable(_quantized(8, 192)[1])
    assert not nf4_lora.usable(_quantized(8, 80)[1])  # a quant block would straddle two rows


# --- The fused projections over merged bases ---------------------------------------------------


def _nf4_block(dtype: torch.dtype, inter: int = INTER) -> nn.Module:
    torch.manual_seed(0)
    shapes = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV),
              "gate_proj": (HIDDEN, inter), "up_proj": (HIDDEN, inter), "down_proj": (inter, HIDDEN)}
    block = nn.Module()
    for name, (i, o) in shapes.items():
        q = bnb.nn.Linear4bit(i, o, bias=False, compute_dtype=dtype, quant_type="nf4")
        dense = (torch.randn(o, i) / i**0.5).to(dtype)
        q.weight = bnb.nn.Params4bit(dense, requires_grad=False, compress_statistics=True, quant_type="nf4")
        setattr(block, name, q)
    block = block.to("cpu")  # quantizes
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(shapes),
                             rank_pattern={"up_proj": 4}, alpha_pattern={"gate_proj": 24})
    block = peft.inject_adapter_in_model(config, block)
    for name in shapes:
        nn.init.normal_(getattr(block, name).lora_B["default"].weight, std=0.2)
    return block


def _weights(block: nn.Module, names: tuple[str, ...]) -> list[LoRAWeights]:
    return [LoRAWeights.from_peft(getattr(block, n))[0] for n in names]


def _params(block: nn.Module, names: tuple[str, ...]) -> list[torch.Tensor]:
    return [p for n in names for p in (getattr(block, n).lora_A["default"].weight, getattr(block, n).lora_B["default"].weight)]


def _dense(block: nn.Module):
    """PEFT's projection math in fp32 with each base replaced by its exact dequantization (the
    truth; bitsandbytes 0.50's CPU dequantization is wrong where quant blocks straddle rows)."""
    def proj(name: str, x: torch.Tensor) -> torch.Tensor:
        layer = getattr(block, name)
        weight = layer.get_base_layer().weight
        dense = nf4.dequantize_reference(weight, weight.quant_state, torch.float32)
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        return x @ dense.t() + (x @ a.float().t()) @ b.float().t() * layer.scaling["default"]

    return proj


MLP, QKV = ("gate_proj", "up_proj", "down_proj"), ("q_proj", "k_proj", "v_proj")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [INTER, 80])  # 80: down's rows are not whole blocks, it stays unmerged
def test_merged_projections_match_fp32_peft_math(
    backend: str, dtype: torch.dtype, inter: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = _nf4_block(dtype, inter)
    merges = lora_module._merges
    assert merges(_weights(block, MLP)[:2]) and merges(_weights(block, QKV))
    assert merges(_weights(block, MLP)[2:]) == (inter == INTER)
    merged_calls = []
    real = nf4_lora.dequantize_merged
    monkeypatch.setattr(nf4_lora, "dequantize_merged", lambda *a, **k: merged_calls.append(1) or real(*a, **k))
    proj = _dense(block)
    x = torch.randn((2, 9, HIDDEN), generator=torch.Generator().manual_seed(2)).to(dtype)
    cases = [
        (MLP, lambda x: lora_mlp(x, *_weights(block, MLP)),
         lambda x: proj("down_proj", F.silu(proj("gate_proj", x)) * proj("up_proj", x))),
        (QKV, lambda x: lora_qkv(x, *_weights(block, QKV)), lambda x: tuple(proj(n, x) for n in QKV)),
    ]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for names, ours, truth in cases:
        params = _params(block, names)
        got, expected = _run(ours, x, params), _run(truth, x.float(), params)
        _close(got[0], expected[0], tol)
        _close(got[1], expected[1], tol)
    # _run's forward builds a graph and still runs over W': Q, K, V, gate, up, and down when whole.
    assert len(merged_calls) == 5 + (inter == INTER)


def test_no_grad_forward_forms_no_rank_products(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A checkpoint's first pass: with every base merged, no X A^T is formed and nothing saved.
    block = _nf4_block(torch.float32)
    x = torch.randn(2, 9, HIDDEN)
    with_grad = lora_mlp(x.requires_grad_(), *_weights(block, MLP))
    shrinks = []
    monkeypatch.setattr(lora_module, "_shrink", lambda *a, _f=lora_module._shrink: shrinks.append(1) or _f(*a))
    with torch.no_grad():
        y = lora_mlp(x, *_weights(block, MLP))
        q = lora_qkv(x, *_weights(block, QKV))[0]
    assert shrinks == [] and not y.requires_grad
    _close([y], [with_grad.detach()], 1e-5)
    torch.testing.assert_close(q, _dense(block)("q_proj", x.detach()), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1000, 1024), (14336 // 8, 4096)])
def test_cuda_merged_dequantize(shape: tuple[int, int]) -> None:
    import bitsandbytes.functional as bnbf

    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16) / shape[1] ** 0.5
    packed, state = bnbf.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
    a, b = torch.randn(16, shape[1], device="cuda"), torch.randn(shape[0], 16, device="cuda") * 0.01
    got = nf4_lora.dequantize_merged(packed, state, a, b, 2.0, torch.bfloat16).clone()
    w_bnb = bnbf.dequantize_4bit(packed, state).double()
    exact = w_bnb + 2.0 * (b.double() @ a.double())
    # bitsandbytes' W is itself rounded to bf16 (half a unit of |W|, which W + s B A can cancel
    # below), ours rounds W + s B A once (half a unit); the rank-16 products take A and B rounded
    # to bf16 (unit roundoff 2^-8 each, so 2 x 2^-8 of each term |b_k a_k|).
    operands = 2.0 * (2 * 2.0**-8) * (b.abs() @ a.abs()).double()  # s = 2
    bound = 2.0**-8 * (w_bnb.abs() + exact.abs()) + operands
    assert ((got.double() - exact).abs() <= bound).all()
    zero = nf4_lora.dequantize_merged(packed, state, a, torch.zeros_like(b), 2.0, torch.bfloat16)
    assert torch.equal(zero, bnbf.dequantize_4bit(packed, state))


@pytest.mark.parametrize("inter", [INTER, 80])  # 80: down cannot merge (its W_d is still dequantized once)
def test_deferred_mlp_forms_each_weight_once(backend: str, inter: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # A deferred MLP (a long sequence's recompute) runs forward and backward in its backward,
    # over gate's and up's W' formed once for both products (18 rows in chunks of 4 here): its
    # gradients are PEFT's fp32 math, with 2 merged dequantizations and W_d's plain one.
    from kestrel.kernels.lora import mlp as mlp_module

    monkeypatch.setattr(mlp_module, "DEFERRED_ROWS", 4)
    monkeypatch.setattr(mlp_module, "lowers_peak", lambda *a: True)  # at these tiny shapes it would not
    block = _nf4_block(torch.float32, inter)
    merged, plain = [], []
    real_merged, real_plain = nf4_lora.dequantize_merged, nf4.dequantize
    monkeypatch.setattr(nf4_lora, "dequantize_merged", lambda *a, **k: merged.append(a[0].shape) or real_merged(*a, **k))
    monkeypatch.setattr(nf4, "dequantize", lambda *a, **k: plain.append(a[0].shape) or real_plain(*a, **k))
    proj = _dense(block)
    x = torch.randn((2, 9, HIDDEN), generator=torch.Generator().manual_seed(2))
    params = _params(block, MLP)
    got = _run(lambda x: lora_mlp(x, *_weights(block, MLP), discard_output=True), x, params)
    expected = _run(lambda x: proj("down_proj", F.silu(proj("gate_proj", x)) * proj("up_proj", x)), x, params)
    _close(got[1], expected[1], 1e-5)
    assert (len(merged), len(plain)) == (2, 1)
