"""A first optimizer step's effect on the loss, in 16-bit, is the effect fp32 math gives it.

After one Adam step from a fresh adapter (B = 0) every B element is about lr in size, and the
adapter term is far below half a bf16 unit of the projections' outputs. The fused path rounds
each output once, after the adapter term is in (`kestrel.kernels.lora.lora`, "Rounding"), so the loss moves
as it does in fp32: on a CPU, and for QLoRA on CUDA (a 16-bit base on CUDA does not yet: cuBLAS
rounds X W^T before it adds the term). PEFT's own bf16 forward rounds X W^T first and loses most
of the step: the tests check that too, so they cannot pass on a model where the question does
not arise.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from kestrel.config import ALL_LINEAR, LoraSettings
from kestrel.model.loader import load
from kestrel.model.lora import attach_lora

peft = pytest.importorskip("peft")


def _hf(folder: Path, dtype: torch.dtype, device: str, qlora: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw: dict = dict(dtype=dtype)
    if qlora:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
        kw["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(folder, **kw).to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    config = peft.LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=list(ALL_LINEAR), bias="none")
    return peft.get_peft_model(model, config)


def _kestrel(folder: Path, device: str, qlora: bool) -> torch.nn.Module:
    model, _ = load(str(folder), 256, load_in_4bit=qlora, dtype="bf16", device=device)
    for p in model.parameters():
        p.requires_grad_(False)
    return attach_lora(model, LoraSettings(r=16, alpha=16, dropout=0.0))


def _short(name: str) -> str:
    return name[name.index("layers."):]


def _adapters(model: torch.nn.Module, kind: str) -> dict[str, torch.Tensor]:
    return {_short(n): p for n, p in model.named_parameters() if f".lora_{kind}." in n}


def _seed_a(model: torch.nn.Module) -> None:
    """The same A in every model (PEFT's uniform bound), seeded by the parameter's name."""
    with torch.no_grad():
        for name, p in _adapters(model, "A").items():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(((torch.rand(p.shape, generator=gen) * 2 - 1) / p.shape[1] ** 0.5).to(p.device, p.dtype))


def _first_step(model: torch.nn.Module, ids: torch.Tensor, lr: float) -> dict[str, torch.Tensor]:
    """Adam's first step from B = 0: -lr sign(dL/dB) (m / sqrt(v) = sign g)."""
    _seed_a(model)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: -lr * p.grad.sign() for n, p in _adapters(model, "B").items()}


def _effect(model: torch.nn.Module, ids: torch.Tensor, step: dict[str, torch.Tensor]) -> float:
    """loss(B = 0) - loss(B = step), the same A."""
    _seed_a(model)
    losses = []
    with torch.no_grad():
        for scale in (0.0, 1.0):
            for name, p in _adapters(model, "B").items():
                p.copy_(scale * step[name].to(p.device, p.dtype))
            losses.append(float(model(input_ids=ids, labels=ids).loss))
    return losses[0] - losses[1]


def _check(folder: Path, device: str, qlora: bool) -> None:
    ids = torch.randint(0, 500, (4, 128), generator=torch.Generator().manual_seed(0)).to(device)
    truth_model = _hf(folder, torch.float32, device, qlora)
    step = _first_step(truth_model, ids, lr=1e-4)
    truth = _effect(truth_model, ids, step)
    ours = _effect(_kestrel(folder, device, qlora), ids, step)
    plain = _effect(_hf(folder, torch.bfloat16, device, qlora), ids, step)
    assert truth > 0
    assert ours == pytest.approx(truth, rel=0.15), (ours, truth, plain)
    assert plain < 0.7 * truth, (ours, truth, plain)  # the regime where rounding first loses the step


def test_first_step_moves_the_bf16_loss_as_in_fp32(tiny_model_dir) -> None:
    _check(tiny_model_dir("llama"), "cpu", qlora=False)


@pytest.mark.gpu
@pytest.mark.parametrize("qlora", [
    pytest.param(False, marks=pytest.mark.xfail(strict=True, reason="cuBLAS rounds X W^T before adding the adapter term")),
    True,
], ids=["lora", "qlora"])
def test_cuda_first_step_moves_the_bf16_loss_as_in_fp32(tiny_model_dir, qlora: bool) -> None:
    _check(tiny_model_dir("llama"), "cuda", qlora)
