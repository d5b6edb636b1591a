"""The fused LoRA kernels with the adapter off (PEFT's `disable_adapter()`, the preference and GRPO
reference passes): the base alone, as PEFT computes it, through the same grouped kernels as the
policy, with no adapter product formed and no gradient for the adapter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kestrel.kernels.lora.lora import LoRAWeights, lora_linear, lora_qkv
from kestrel.kernels.lora.mlp import lora_mlp
from kestrel.model.fused_lora import fused_lora_weights
from tests.kernels.test_lora import HIDDEN, MLP, QKV, _nf4_block, _peft_block, _peft_mlp, _peft_qkv, _x

peft = pytest.importorskip("peft")


def _disable(block: nn.Module) -> None:
    for name in (*QKV, *MLP):
        getattr(block, name).enable_adapters(False)


def _poison_adapters(block: nn.Module) -> None:
    """NaN adapters: any adapter product the off path still formed would turn the output NaN."""
    with torch.no_grad():
        for name in (*QKV, *MLP):
            layer = getattr(block, name)
            layer.lora_A["default"].weight.fill_(float("nan"))
            layer.lora_B["default"].weight.fill_(float("nan"))


def _off(block: nn.Module, names: tuple[str, ...]) -> list[LoRAWeights]:
    out = []
    for name in names:
        w, reason = LoRAWeights.from_peft(getattr(block, name), adapter_off=True)
        assert w is not None, reason
        assert w.adapter_off
        out.append(w)
    return out


def _blocks() -> dict[str, nn.Module]:
    return {"fp32": _peft_block(torch.float32), "bf16": _peft_block(torch.bfloat16), "nf4": _nf4_block(torch.float32)}


@pytest.mark.parametrize("kind", ["fp32", "bf16", "nf4"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_adapter_off_equals_peft_disabled_and_reads_no_adapter(kind: str, backend: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", backend)  # triton: NF4 dequantization and GLU, interpreted on CPU
    block = _blocks()[kind]
    _disable(block)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    x = _x(dtype)
    with torch.no_grad():
        expected_qkv = _peft_qkv(block)(x)
        expected_mlp = _peft_mlp("swiglu")(block)(x)
        _poison_adapters(block)
        got_qkv = lora_qkv(x, *_off(block, QKV))
        got_mlp = lora_mlp(x, *_off(block, MLP))
        got_q = lora_linear(x, _off(block, QKV)[0])
    # fp32: the Triton GLU's sigmoid differs from torch's in the last bits; bf16: one rounding apart
    tol = {"atol": 1e-6, "rtol": 1e-5} if kind != "bf16" else {"atol": 2e-2, "rtol": 2e-2}
    for got, expected in zip((*got_qkv, got_mlp, got_q), (*expected_qkv, expected_mlp, expected_qkv[0])):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("kind", ["fp32", "nf4"])
def test_adapter_off_backward_gives_the_input_gradient_and_none_to_the_adapter(kind: str) -> None:
    block = _blocks()[kind]
    _disable(block)  # PEFT also stops A and B from needing a gradient
    adapters = [p for n, p in block.named_parameters() if "lora_" in n]
    assert adapters and not any(p.requires_grad for p in adapters)
    x = _x(torch.float32)
    cotangent = torch.randn((*x.shape[:-1], x.shape[-1]), generator=torch.Generator().manual_seed(5))

    def grad_of(fn) -> torch.Tensor:
        xi = x.clone().requires_grad_()
        (fn(xi) * cotangent).sum().backward()
        return xi.grad

    got = grad_of(lambda t: lora_mlp(t, *_off(block, MLP)))
    expected = grad_of(_peft_mlp("swiglu")(block))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in adapters)


def test_refusal_depends_on_whether_the_adapter_is_off() -> None:
    layer = _peft_block(use_dora=True).q_proj
    assert "DoRA" in LoRAWeights.from_peft(layer)[1]
    assert "adapters are enabled" in LoRAWeights.from_peft(layer, adapter_off=True)[1]
    layer.enable_adapters(False)
    assert LoRAWeights.from_peft(layer)[1] == "adapters are disabled"
    off, reason = LoRAWeights.from_peft(layer, adapter_off=True)  # PEFT runs the base alone: DoRA plays no part
    assert off is not None and off.adapter_off, reason


def test_fused_weights_follow_the_adapter_state_and_keep_both() -> None:
    layer = _peft_block().q_proj
    on = fused_lora_weights(layer)
    assert on is not None and not on.adapter_off
    layer.enable_adapters(False)
    off = fused_lora_weights(layer)
    assert off is not None and off.adapter_off
    layer.enable_adapters(True)
    assert fused_lora_weights(layer) is on  # toggled every step: each state's weights are kept, not rebuilt
    layer.enable_adapters(False)
    assert fused_lora_weights(layer) is off


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_adapter_off_matches_bitsandbytes_base(dtype: torch.dtype) -> None:
    """On the GPU, over bitsandbytes' own NF4 forward (what PEFT runs with the adapter disabled)."""
    block = _nf4_block(dtype, device="cuda")
    _disable(block)
    x = _x(dtype, (3, 33, HIDDEN)).cuda()
    with torch.no_grad():
        expected = (*_peft_qkv(block)(x), _peft_mlp("swiglu")(block)(x))
        got = (*lora_qkv(x, *_off(block, QKV)), lora_mlp(x, *_off(block, MLP)))
    for g, e in zip(got, expected):
        scale = e.float().abs().max().item()
        torch.testing.assert_close(g.float(), e.float(), rtol=2e-2, atol=2e-2 * scale)
