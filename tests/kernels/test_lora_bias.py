"""Fused LoRA over a base layer with a frozen bias (Qwen2's Q/K/V, gpt-oss's attention): against PEFT,
outputs and the gradients of x and of every lora_A / lora_B, over 16-bit and NF4 bases, merged and
not; a trainable bias stays on PEFT's path; the MLP Function refuses biased projections, and the
patched MLP then fuses each projection on its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kestrel.kernels import nf4
from kestrel.kernels.lora import nf4_lora
from kestrel.kernels.lora.lora import LoRAWeights, lora_linear, lora_projections, lora_qkv
from kestrel.kernels.lora.mlp import lora_mlp
from tests.kernels.test_lora import MLP, QKV, _check, _peft_block, _peft_qkv, _weights, _x

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biased_linear_and_qkv_match_peft(dtype: torch.dtype) -> None:
    block = _peft_block(dtype, bias=True)
    assert all(getattr(block, n).get_base_layer().bias.abs().sum() > 0 for n in QKV)  # a real bias, not zeros
    _check(block, ("q_proj",), lambda ws: lambda x: lora_linear(x, ws[0]), lambda b: b.q_proj, _x(dtype))
    _check(block, QKV, lambda ws: lambda x: lora_qkv(x, *ws), _peft_qkv, _x(dtype))


def test_the_bias_is_added_once() -> None:
    # With B = 0 the adapter adds nothing: y must be x W^T + b exactly (fp32), not b twice or never.
    block = _peft_block(torch.float32, bias=True)
    nn.init.zeros_(block.k_proj.lora_B["default"].weight)
    (w,) = _weights(block, ("k_proj",))
    base = block.k_proj.get_base_layer()
    x = _x(torch.float32)
    torch.testing.assert_close(lora_linear(x, w), base(x), rtol=1e-6, atol=1e-6)


def test_biased_base_with_adapters_off_is_the_base() -> None:
    # The DPO / KTO / GRPO reference pass: PEFT runs the base alone, bias included.
    block = _peft_block(torch.float32, bias=True)
    block.v_proj.enable_adapters(False)
    w, why = LoRAWeights.from_peft(block.v_proj, adapter_off=True)
    assert w is not None and w.adapter_off, why
    x = _x(torch.float32)
    torch.testing.assert_close(lora_linear(x, w), block.v_proj(x), rtol=1e-6, atol=1e-6)


def test_a_trainable_base_bias_stays_on_peft() -> None:
    block = _peft_block(torch.float32, bias=True)
    block.q_proj.get_base_layer().bias.requires_grad_(True)
    w, why = LoRAWeights.from_peft(block.q_proj)
    assert w is None and "bias is trainable" in why
    assert LoRAWeights.from_peft(block.k_proj)[0] is not None  # its bias is frozen


def test_a_bias_of_the_wrong_length_is_refused() -> None:
    (w,) = _weights(_peft_block(torch.float32, bias=True), ("q_proj",))
    with pytest.raises(ValueError, match="one value an output"):
        LoRAWeights(*w._flat(), bias=torch.zeros(w.out_features + 1))


def test_lora_mlp_refuses_biased_projections() -> None:
    gate, up, down = _weights(_peft_block(torch.float32, bias=True), MLP)
    with pytest.raises(ValueError, match="bias-free"):
        lora_mlp(_x(torch.float32), gate, up, down)


# --- NF4 bases with a bias ---------------------------------------------------------------------

IN, OUT = 128, 48  # rows split into whole quant blocks: the merged path (`nf4_lora.usable`) can run


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(IN, OUT, bias=True)
        self.k_proj = nn.Linear(IN, OUT // 2, bias=True)


def _nf4_pair(dtype: torch.dtype, device: str = "cpu") -> tuple[nn.Module, nn.Module]:
    """(an NF4 block of two biased projections with PEFT LoRA, its fp32 twin: the same adapters
    over the dequantized weights and the same bias)."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    dense = _Pair()
    block = nn.Module()
    for name in ("q_proj", "k_proj"):
        lin = getattr(dense, name)
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=True, compute_dtype=dtype, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(lin.weight.data.to(dtype), requires_grad=False, compress_statistics=True,
                                     quant_type="nf4")
        q.bias = nn.Parameter(lin.bias.data.to(dtype), requires_grad=False)
        setattr(block, name, q)
    block = block.to(device)  # quantizes
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj"])
    block = peft.inject_adapter_in_model(config, block)
    twin = peft.inject_adapter_in_model(config, _Pair()).to(device)
    for name in ("q_proj", "k_proj"):
        src, dst = getattr(block, name), getattr(twin, name)
        nn.init.normal_(src.lora_B["default"].weight, std=0.2)
        weight = src.get_base_layer().weight
        dst.get_base_layer().weight.data = nf4.dequantize_reference(weight, weight.quant_state, torch.float32)
        dst.get_base_layer().bias.data = src.get_base_layer().bias.data.float()
        for part in ("lora_A", "lora_B"):
            getattr(dst, part)["default"].weight.data = getattr(src, part)["default"].weight.data.float()
    return block, twin


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_biased_projections_match_peft(dtype: torch.dtype, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", backend)  # triton: the merged dequantization, interpreted
    block, twin = _nf4_pair(dtype)
    ws = _weights(block, ("q_proj", "k_proj"))
    assert all(w.bias is not None and w.quant_state is not None and nf4_lora.usable(w.quant_state) for w in ws)
    pair = lambda ws: lambda x: lora_projections(x, *ws)  # noqa: E731
    ref = lambda b: lambda x: (b.q_proj(x), b.k_proj(x))  # noqa: E731
    _check(block, ("q_proj", "k_proj"), pair, ref, _x(dtype, (2, 5, IN)), twin=twin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_biased_projections_match_peft(dtype: torch.dtype) -> None:
    # On CUDA the adapter's product goes first on large shapes and second on small ones
    # (`_ADAPTER_FIRST_MIN`), and cuBLAS adds the bias in its epilogue: both orders, 16-bit and NF4 bases.
    block = _peft_block(dtype, bias=True).cuda()
    x = _x(dtype, (3, 33, block.q_proj.in_features)).cuda()
    _check(block, QKV, lambda ws: lambda x: lora_qkv(x, *ws), _peft_qkv, x)
    wide = nn.Module()
    wide.q_proj = nn.Linear(2048, 4096, bias=True)  # out x in = 2^23: the adapter's product goes first
    wide = peft.inject_adapter_in_model(peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"]), wide)
    nn.init.normal_(wide.q_proj.lora_B["default"].weight, std=0.2)
    wide = wide.to("cuda", dtype)
    _check(wide, ("q_proj",), lambda ws: lambda x: lora_linear(x, ws[0]), lambda b: b.q_proj, _x(dtype, (3, 33, 2048)).cuda())
    nf4_block, twin = _nf4_pair(dtype, "cuda")
    pair = lambda ws: lambda x: lora_projections(x, *ws)  # noqa: E731
    ref = lambda b: lambda x: (b.q_proj(x), b.k_proj(x))  # noqa: E731
    _check(nf4_block, ("q_proj", "k_proj"), pair, ref, _x(dtype, (3, 33, IN)).cuda(), twin=twin)
